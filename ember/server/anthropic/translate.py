"""A Messages API request -> the chat completions request that serves it (ember.server.chat).

The whole Anthropic endpoint is this translation plus the answer's (message.py, stream.py): one engine
path, so a Messages request and the chat request it becomes get the same prompt, the same sampling and
the same prefix-cache hits.

What maps to what:
- `system` (a string or text blocks) -> one system message; Claude Code's billing-header line is dropped
  (`drop_billing_header`);
- a mid-conversation `system` message (Claude Code's reminders) -> its text, in place, in the user turn it
  follows (`_late_system`); one whose `clear_at` is next_user_message is left out once a later user turn
  has come;
- a user turn's text blocks -> a user message; its `tool_result` blocks -> tool messages (in place, so a
  template sees them right after the assistant's calls), an error result's text prefixed `Error: `, since
  a chat message has no field for it and the model must see that the tool failed;
- an assistant turn's text -> content, `thinking` -> reasoning_content, `tool_use` -> tool_calls (input as
  JSON text, as OpenAI sends arguments; `redacted_thinking` carries nothing a local model can read);
- a last assistant turn is a prefill: the answer continues it (continue_final_message), as Anthropic does;
- `tools` with `input_schema` -> function tools; server tools (`web_search_...`: a versioned type and no
  schema) are left out with a log line, since only Anthropic runs them;
- `tool_choice` auto / any / tool / none -> auto / required / the named function / none, and
  `disable_parallel_tool_use` -> parallel_tool_calls false;
- `thinking` enabled (adaptive, or any other way to think) -> the template's enable_thinking true and
  reasoning returned as thinking blocks; disabled or absent (Anthropic's default) -> enable_thinking
  false, no thinking blocks;
- `output_config.format` (a json_schema) -> response_format json_schema, held by a grammar;
- `stop_sequences` -> stop, `max_tokens`, `temperature`, `top_p`, `top_k` as they are.

Image, document and every other block type is refused with a 400 that names the block and where it is.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from ember.errors import ParamError
from ember.server.anthropic.protocol import CountTokensRequest, InputMessage, MessagesRequest, ToolParam
from ember.server.protocol import ChatCompletionRequest

logger = logging.getLogger("ember.server")

# Claude Code's first system block: `x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=...;`
BILLING_HEADER = "x-anthropic-billing-header:"
# What tool_choice's Anthropic types are in the chat request
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_MEDIA = ("image", "document", "file", "container_upload")


def drop_billing_header(text: str) -> str:
    """text without its lines that start with Claude Code's billing header.

    Claude Code sends `x-anthropic-billing-header: ...; cch=<hash>;` as the first system block of every
    request, and the cch= value differs from one request to the next: kept, it would make the first
    tokens of every prompt new, and no prefix-cache hit could reach past them. The line tells the model
    nothing. Only whole lines that start with the header go; the rest of the text is kept to the byte."""
    if BILLING_HEADER not in text:
        return text
    kept = [line for line in text.splitlines(keepends=True) if not line.startswith(BILLING_HEADER)]
    logger.debug("anthropic: dropped Claude Code's billing header line from the system prompt")
    return "".join(kept)


def chat_request_dict(req: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """The chat completions request (as JSON) that serves req; raises ParamError for what ember cannot serve."""
    messages = _system(req.system) + _conversation(req.messages)
    continues = req.messages[-1].role == "assistant"
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    out: dict[str, Any] = {
        "messages": messages,
        "chat_template_kwargs": {"enable_thinking": thinking},
        "include_reasoning": thinking,
    }
    if continues:
        out["add_generation_prompt"], out["continue_final_message"] = False, True
    tools = _tools(req.tools or [])
    if tools:
        out["tools"] = tools
    if req.tool_choice is not None:
        out.update(_tool_choice(req.tool_choice))
    if isinstance(req, MessagesRequest):
        out["max_tokens"] = req.max_tokens
        if req.output_config is not None and req.output_config.format is not None:
            out["response_format"] = _response_format(req.output_config.format)
        if req.output_config is not None and req.output_config.effort is not None:
            # the chat template's effort where it has one (ember.server.reasoning_effort); `thinking` above
            # still decides enable_thinking, as an explicit template variable wins
            out["reasoning_effort"] = req.output_config.effort
        if req.stop_sequences:
            out["stop"] = list(req.stop_sequences)
        for name in ("temperature", "top_p", "top_k"):
            if getattr(req, name) is not None:
                out[name] = getattr(req, name)
    return out


def to_chat_request(req: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(chat_request_dict(req))


# -- messages -----------------------------------------------------------------------------------------


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        text = drop_billing_header(system)
    else:
        texts = [drop_billing_header(block.text) for block in system]
        text = "\n".join(t for t in texts if t)
    return [{"role": "system", "content": text}] if text else []


def _conversation(messages: list[InputMessage]) -> list[dict]:
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m.role == "system":
            if m.clear_at == "next_user_message" and any(later.role == "user" for later in messages[i + 1 :]):
                continue  # it was for the user turn it followed, and a later one has come
            _late_system(out, _system_text(m.content, f"messages[{i}]"))
        elif isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            out += _user_turn(m.content, f"messages[{i}]")
        else:
            out.append(_assistant_turn(m.content, f"messages[{i}]"))
    return out


def _late_system(out: list[dict], text: str) -> None:
    """A mid-conversation system message, in place, as user text: appended to the user message it follows,
    or a user message of its own after tool results or an assistant turn.

    Not a chat `system` message: Qwen3.5's and Qwen3-Coder's templates raise "System message must be at
    the beginning" for one anywhere else, and others drop it. Not merged into the leading system message
    either: that would change the prompt's first tokens, and with them every prefix-cache hit of the
    conversation, each time one is added."""
    if not text:
        return
    previous = out[-1] if out else None
    if previous is not None and previous["role"] == "user" and isinstance(previous["content"], str):
        previous["content"] = f"{previous['content']}\n\n{text}" if previous["content"] else text
    else:
        out.append({"role": "user", "content": text})


def _system_text(content: str | list[dict], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.get("type") != "text":
            _refuse(
                block.get("type"), f"{where}.content[{j}]", "text blocks in a system message (declare tools in `tools`)"
            )
        texts.append(_text(block, f"{where}.content[{j}]"))
    return "\n".join(texts)


def _user_turn(blocks: list[dict], where: str) -> list[dict]:
    """A user turn's blocks in order: text runs become user messages, each tool_result a tool message."""
    out: list[dict] = []
    texts: list[str] = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text(block, f"{where}.content[{j}]"))
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
                texts = []
            out.append(_tool_result(block, f"{where}.content[{j}]"))
        else:
            _refuse(kind, f"{where}.content[{j}]", "text and tool_result blocks")
    if texts or not out:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_turn(blocks: list[dict], where: str) -> dict:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        kind, at = block.get("type"), f"{where}.content[{j}]"
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "thinking":
            thoughts.append(_field(block, "thinking", str, at))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif kind == "tool_use":
            calls.append(_tool_use(block, at))
        else:
            _refuse(kind, at, "text, thinking and tool_use blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_use(block: dict, where: str) -> dict:
    args = block.get("input")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ParamError(f"{where}.input must be an object (the tool's arguments)", "messages")
    return {
        "id": _field(block, "id", str, where),
        "type": "function",
        "function": {"name": _field(block, "name", str, where), "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _tool_result(block: dict, where: str) -> dict:
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for k, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                _refuse(kind, f"{where}.content[{k}]", "text blocks in a tool_result")
            parts.append(_text(part, f"{where}.content[{k}]"))
        text = "\n".join(parts)
    else:
        raise ParamError(f"{where}.content must be a string or a list of text blocks", "messages")
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": _field(block, "tool_use_id", str, where), "content": text}


def _text(block: dict, where: str) -> str:
    return _field(block, "text", str, where)


def _field(block: dict, name: str, kind: type, where: str):
    value = block.get(name)
    if not isinstance(value, kind):
        raise ParamError(f"{where}.{name} is required and must be a {kind.__name__}", "messages")
    return value


def _refuse(kind: Any, where: str, allowed: str) -> None:
    if kind in _MEDIA:
        raise ParamError(
            f"{where} is a {kind!r} block: ember serves text models and reads no images or documents; "
            "send the content as text",
            "messages",
        )
    raise ParamError(f"{where}: content block type {kind!r} is not supported here; send {allowed}", "messages")


# -- tools --------------------------------------------------------------------------------------------


def _tools(tools: list[ToolParam]) -> list[dict]:
    out = []
    for tool in tools:
        if tool.type not in (None, "custom"):
            logger.warning("anthropic: server tool %r (type %s) left out: only Anthropic runs it", tool.name, tool.type)
            continue
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema or {"type": "object"}}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if choice.type == "tool":
        if not choice.name:
            raise ParamError('tool_choice of type "tool" needs the tool\'s name', "tool_choice")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = _TOOL_CHOICES[choice.type]
    if choice.disable_parallel_tool_use:
        out["parallel_tool_calls"] = False
    return out


def _response_format(fmt) -> dict[str, Any]:
    if fmt.type != "json_schema" or not isinstance(fmt.schema_, dict):
        raise ParamError(
            f'output_config.format of type {fmt.type!r} is not supported; send {{"type": "json_schema", "schema": {{...}}}}',
            "output_config",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
