"""Which reasoning parser a server uses: --reasoning-parser's, or, where the flag is not given and the chat
template always thinks, qwen3's.

A template always thinks when its generation prompt opens `<think>` even with enable_thinking false
(Qwen3.8-Flash-Next: thinking has no off switch; DeepSeek-R1). Every answer of such a model starts inside its
reasoning, so without a parser the reasoning would come back as the answer's content and a forced tool call
or JSON answer would be constrained from the first reasoning token; llama-server extracts reasoning by
default for the same reason. qwen3's parser reads where the reasoning starts from the prompt, so it serves
any template that opens `<think>`. A template that thinks by default but can be switched off (Qwen3, Qwen3.5)
keeps vLLM's rule: no parser unless the flag names one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ember.structured.reasoning import prompt_state

logger = logging.getLogger("ember.server")

AUTO_PARSER = "qwen3"
PROBE = [{"role": "user", "content": "Hello."}]


@dataclass(frozen=True)
class ReasoningParserChoice:
    name: str | None  # a --reasoning-parser value, or None: reasoning stays in the content
    reason: str


def always_thinks(tokenizer, template: str | None) -> bool:
    """Whether the template's generation prompt opens a think block with enable_thinking false."""
    try:
        text = tokenizer.apply_chat_template(
            PROBE, add_generation_prompt=True, chat_template=template, enable_thinking=False
        )
    except Exception:  # a probe: a template that cannot render a lone user turn decides nothing here
        return False
    return prompt_state(text) == "open"


def resolve_reasoning_parser(flag: str | None, tokenizer, template: str | None) -> ReasoningParserChoice:
    """The parser for `--reasoning-parser flag` (None: qwen3's where the template always thinks, else none)."""
    if flag is not None:
        return ReasoningParserChoice(flag, f"--reasoning-parser {flag}")
    if always_thinks(tokenizer, template):
        return ReasoningParserChoice(
            AUTO_PARSER, "the chat template always opens <think> (thinking has no off switch), so answers start in it"
        )
    return ReasoningParserChoice(None, "no --reasoning-parser, and the chat template can answer without thinking")
