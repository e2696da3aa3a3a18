"""A chat answer as Anthropic's Message object: the whole answer of POST /v1/messages, and the pieces
(content blocks, stop reason, usage) its stream (stream.py) is made of.

The content blocks are ember.server.chat_blocks' blocks, named in Anthropic's words: THINKING ->
`thinking` (with an empty `signature`: ember signs nothing, and a client sends it back as it got it),
TEXT -> `text`, TOOL_CALL -> `tool_use` (its `input` the arguments object). So a whole answer and a
streamed one have the same blocks, in the order the model wrote them.

Usage follows Anthropic's convention: `input_tokens` counts the prompt tokens that were not read from
the prefix cache, `cache_read_input_tokens` those that were (ember's prefix-cache hit), and nothing is
ever written to a cache on request, so `cache_creation_input_tokens` is 0.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ember.server.chat_blocks import TEXT, THINKING, Block, ChatBlocks

logger = logging.getLogger("ember.server")

# chat finish_reason -> stop_reason ("stop" is end_turn, or stop_sequence when a stop string matched)
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def message_id(chat_id: str) -> str:
    """`msg_<hex>` for the chat request `chatcmpl-<hex>`: the same hex, so the server log's id finds it."""
    return "msg_" + chat_id.rsplit("-", 1)[-1]


def usage(prompt_tokens: int, output_tokens: int, cached: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: list[str]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish_reason and the chat choice's stop_reason (the stop
    string that ended it, if one did)."""
    if finish_reason == "stop" and isinstance(matched, str) and matched in stop_sequences:
        return "stop_sequence", matched
    return _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def opening_block(block: Block) -> dict[str, Any]:
    """A block as `content_block_start` announces it: empty, to be filled by its deltas."""
    if block.kind == THINKING:
        return {"type": "thinking", "thinking": "", "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": ""}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": {}}


def whole_block(block: Block) -> dict[str, Any]:
    """A finished block as a whole Message holds it."""
    if block.kind == THINKING:
        return {"type": "thinking", "thinking": block.text, "signature": ""}
    if block.kind == TEXT:
        return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": tool_input(block)}


def tool_input(block: Block) -> dict[str, Any]:
    """A tool call's arguments as the object `input` must be. The chat parser hands over what the model
    wrote; text that is no JSON object (cut off by max_tokens, a model off its format) gives {} and a
    warning with the text, since a Message has no place for it."""
    try:
        value = json.loads(block.text) if block.text.strip() else {}
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        return value
    logger.warning(
        "anthropic: tool call %s (%s) has arguments that are no JSON object: %r", block.call_id, block.name, block.text
    )
    return {}


def whole_message(answer: dict, *, model: str, cached: int, stop_sequences: list[str]) -> dict[str, Any]:
    """The Message for a whole chat answer (ChatHandler.whole's dict, one choice); cached: its prefix-cache hit."""
    choice = answer["choices"][0]
    blocks = ChatBlocks()
    blocks.feed_message(choice["message"], choice["finish_reason"], answer["usage"])
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), stop_sequences)
    return {
        "id": message_id(answer["id"]),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [whole_block(b) for b in blocks.blocks],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(answer["usage"]["prompt_tokens"], answer["usage"]["completion_tokens"], cached),
    }
