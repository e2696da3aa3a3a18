"""Anthropic Messages API request schemas (pydantic), as POST /v1/messages and /v1/messages/count_tokens take them.

Lenient where clients are: every model allows fields it does not name (`metadata`, `cache_control`,
`citations`, `service_tier`, beta fields, ...), which are ignored, because Claude Code and the SDKs send
them on every request and none of them changes what a local model writes. Content blocks are kept as
plain dicts here: which block types ember can serve is ember.server.anthropic.translate's business, so a
refused block (an image) gets a 400 that names it and its place, not a pydantic union error.

Ranges follow Anthropic's API (temperature 0..1), so a request that Anthropic refuses is refused here too.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputMessage(_Lenient):
    """A turn of the conversation. `system` is a mid-conversation system message (Claude Code sends its
    reminders as one after the user's turn); `clear_at` says whether it stays in front of the model after
    the next user turn ("never", the default) or not ("next_user_message")."""

    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]
    clear_at: Literal["next_user_message", "never"] | None = None


class TextBlockParam(_Lenient):
    """A block of `system` (only text blocks may go there)."""

    type: Literal["text"]
    text: str


class ToolParam(_Lenient):
    """A tool the model may call. A client tool has an `input_schema` (type absent or "custom"); Anthropic's
    server tools (`web_search_20250305`, ...) have a versioned type and no schema: ember cannot run them."""

    name: str = Field(min_length=1)
    type: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # for type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Lenient):
    """`disabled`, or a way to think: `enabled` (with a token budget ember does not enforce), `adaptive`,
    `between_tools` and whatever Anthropic adds next, all served as thinking on (the template lets the model
    think; how much is the model's)."""

    type: str = Field(min_length=1)
    budget_tokens: int | None = None


class OutputFormat(_Lenient):
    type: str
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class OutputConfig(_Lenient):
    """`format`: a JSON schema the answer must meet (structured outputs); `effort`: the chat template's
    reasoning_effort where it has one (low / medium / high / max, fitted to the template's values)."""

    format: OutputFormat | None = None
    effort: str | None = None


class _Prompt(_Lenient):
    """What both endpoints render into a prompt."""

    model: str = Field(min_length=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(_Prompt):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)


class CountTokensRequest(_Prompt):
    """POST /v1/messages/count_tokens: the prompt of a Messages request, without its sampling fields."""
