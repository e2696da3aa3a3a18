"""OpenAI request schemas (pydantic) and the JSON shapes ember answers with.

Requests are validated by pydantic (types, simple ranges); the sampling knobs are validated
once more by SamplingParams. Fields vLLM accepts beyond OpenAI's (top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output,
skip_special_tokens, chat_template_kwargs, add_generation_prompt, structured_outputs and the legacy
guided_* fields) are accepted the same way.
Unknown fields are ignored with a log line, as vLLM does.

Responses are built as plain dicts: a streaming chunk is built once per token per request,
and a dict plus json.dumps costs a fraction of a pydantic model round trip.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit generator seed, as vLLM checks
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    user: str | None = None
    # vLLM's extra sampling knobs
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    # structured outputs: vLLM's object and its legacy guided_* fields (ember.server.structured)
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structural_tag: str | None = None
    # vLLM's token-id echoes
    return_token_ids: bool | None = None  # prompt_token_ids and each choice's token_ids in the answer
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens `token_id:N`
    prompt_logprobs: int | None = Field(None, ge=-1)  # vLLM's: top-N logprobs of each prompt token (-1 = all)
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1
    )  # vLLM's: keep the prompt's last N tokens (-1: max_model_len)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or ())


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys go to the template as they are.
    model_config = ConfigDict(extra="allow")
    role: str = Field(
        min_length=1
    )  # system / developer / user / assistant / tool, or a role of the model's own template (vLLM's)
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    # an assistant turn's reasoning, under either name clients send it (vLLM's older and newer); the
    # template gets it as reasoning_content either way (ember.loader.tokenizer aliases the names)
    reasoning_content: str | None = None
    reasoning: str | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1 = the whole vocabulary; capped by --max-logprobs
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI's: none ... xhigh, fitted to the chat template's values (ember.server.reasoning_effort)
    reasoning_effort: str | None = None
    # vLLM extras for chat
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content from the answer
    continue_final_message: bool = False  # the prompt ends inside the last (assistant) message
    echo: bool = False  # vLLM's: the answer starts with the last message's text when it has the answer's role


class BatchChatCompletionRequest(ChatCompletionRequest):
    """vLLM's /v1/chat/completions/batch: several conversations, the other fields shared by all of them."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(..., min_length=1)


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=-1)  # capped by --max-logprobs
    max_tokens: int | None = Field(16, ge=1)
    suffix: str | None = None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the template first."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[int]


# -- answers ------------------------------------------------------------------------------------


def request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, type_: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    u = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def model_card(name: str, root: str, max_model_len: int, created: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "ember",
        "root": root,
        "parent": None,
        "max_model_len": max_model_len,
    }
