"""Tool-call parsers: a model's tool calls read out of its text, whole or as streaming deltas.

  calls.py      ToolCall, ParsedDelta, call ids: what every parser hands out
  framing.py    the `<tool_call>` ... `</tool_call>` framing every format shares, and its CallBody seam
  hermes.py     Qwen / Hermes JSON bodies (`--tool-call-parser hermes`)
  qwen3_xml.py  Qwen3-Coder XML bodies (`qwen3_coder`, `qwen3_xml`); Hermes JSON accepted inside too
  values.py     an XML parameter's text typed by the tool's JSON schema

The server picks one parser class when it starts (`resolve_tool_parser`): the flag's, or the one the
chat template teaches the model (`parser_for_template`, as llama.cpp decides); each request gets an
instance of its own, given the request's tools. Adding a format is a CallBody, a TaggedToolParser
subclass naming xgrammar's structural tag for it, and a row in TOOL_PARSERS.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import ConfigError
from ember.server.tool_parsers.calls import ParsedDelta, ToolCall, new_call_id
from ember.server.tool_parsers.framing import TaggedToolParser, parse_whole
from ember.server.tool_parsers.hermes import HermesToolParser
from ember.server.tool_parsers.qwen3_xml import Qwen3XmlToolParser

AUTO = "auto"
# --tool-call-parser's names (vLLM's) -> parser class; both XML names are vLLM's, for one format
TOOL_PARSERS: dict[str, type[TaggedToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_coder": Qwen3XmlToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
}

__all__ = [
    "AUTO",
    "TOOL_PARSERS",
    "HermesToolParser",
    "ParsedDelta",
    "Qwen3XmlToolParser",
    "TaggedToolParser",
    "ToolCall",
    "ToolParserChoice",
    "new_call_id",
    "parse_tool_calls",
    "parser_for_template",
    "resolve_tool_parser",
]


@dataclass(frozen=True)
class ToolParserChoice:
    name: str  # a TOOL_PARSERS key
    parser: type[TaggedToolParser]
    reason: str  # why this one: the flag, or what the template shows


def parser_for_template(template: str | None) -> tuple[str, str]:
    """(parser name, why) for a chat template's source: `<function=` and `<parameter=` mean the XML
    form (Qwen3.5, Qwen3-Coder), `<tool_call>` alone the JSON one (Qwen3, Hermes); hermes by default."""
    text = template or ""
    if "<function=" in text and "<parameter=" in text:
        return "qwen3_coder", "the chat template writes tool calls as <function=...><parameter=...> XML"
    if "<tool_call>" in text:
        return "hermes", "the chat template writes tool calls as <tool_call> JSON"
    return "hermes", "the chat template shows no tool-call format, and hermes is the default"


def resolve_tool_parser(flag: str, template: str | None) -> ToolParserChoice:
    """The parser for `--tool-call-parser flag` (auto: chosen from the chat template's source)."""
    if flag == AUTO:
        name, reason = parser_for_template(template)
    elif flag in TOOL_PARSERS:
        name, reason = flag, f"--tool-call-parser {flag}"
    else:
        raise ConfigError(f"--tool-call-parser {flag!r} is not one of {', '.join([AUTO, *TOOL_PARSERS])}")
    return ToolParserChoice(name, TOOL_PARSERS[name], reason)


def parse_tool_calls(
    text: str, parser: type[TaggedToolParser] = HermesToolParser, tools: list[dict] | None = None
) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: (content, None when blank beside calls; the tool calls) of a whole model output."""
    return parse_whole(parser(tools), text)
