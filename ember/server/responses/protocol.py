"""The Responses API's request bodies (pydantic), as OpenAI's SDK, the Agents SDK and Codex send them.

The top-level fields are typed here; `input` items and `tools` stay plain dicts at this level and are
read one by one by ember.server.responses.translate, which validates each against the item models
below, so that a bad item is a 400 that names its place (`input[3]`) and kind.

Lenient by design: fields a client sends that do not change the answer (metadata, user,
prompt_cache_key, include, service_tier, truncation, reasoning.summary, ...) are accepted and
echoed; any other unknown field is ignored with a log line, as the chat endpoint does. Fields that
would need state kept between requests (store, previous_response_id, conversation, background,
prompt) are declared so that the handler can refuse them by name.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputTokensRequest(_Lenient):
    """POST /v1/responses/input_tokens: what makes the prompt (no sampling fields)."""

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = (
        None  # effort: the template's reasoning_effort (translate.py); summary: no effect
    )
    truncation: str | None = None  # "disabled" is what ember does: a prompt too long is a 400
    # state kept between requests: refused (ember is stateless)
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class ResponsesRequest(InputTokensRequest):
    """POST /v1/responses."""

    input: str | list[dict[str, Any]]
    stream: bool = False
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # accepted and echoed; none of them changes the answer
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    include: list[str] | None = None  # e.g. reasoning.encrypted_content: ember's reasoning items carry none
    service_tier: str | None = None
    stream_options: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None  # Codex's session and turn ids
    # state kept between requests: refused (ember is stateless)
    store: bool | None = None  # absent means false here (OpenAI's default is true; Codex sends false)
    background: bool | None = None
    prompt: dict[str, Any] | None = None  # a stored prompt template, by id


# -- input items (validated one by one in translate.py) -----------------------------------------


class ContentPart(_Lenient):
    """A part of a message or of a tool's output: input_text / output_text / refusal carry text;
    input_image / input_file / input_audio are refused (ember serves text models)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class CustomToolCallItem(_Lenient):
    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str


class ToolOutputItem(_Lenient):
    """function_call_output and custom_tool_call_output: what the client's tool returned."""

    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: str | list[ContentPart]


class ReasoningText(_Lenient):
    type: str = "reasoning_text"  # summary_text in `summary`
    text: str


class ReasoningItem(_Lenient):
    """A reasoning item of an earlier answer; encrypted_content (OpenAI's own) has no meaning here."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = []
    content: list[ReasoningText] | None = None


# -- tools (validated one by one in translate.py) -----------------------------------------------


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class CustomToolFormat(_Lenient):
    """Freeform input: plain text, or text in a grammar (`syntax` lark or regex, `definition`)."""

    type: Literal["text", "grammar"]
    syntax: str | None = None
    definition: str | None = None


class CustomTool(_Lenient):
    """Codex's freeform tools (apply_patch): the model writes the input as raw text."""

    type: Literal["custom"]
    name: str = Field(min_length=1)
    description: str | None = None
    format: CustomToolFormat | None = None
