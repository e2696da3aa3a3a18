"""A Responses API request -> the chat completions request that answers it (one engine path).

Input items become chat messages in order:

- `instructions`, and the system / developer messages before the first other message, become one
  leading system message (their texts joined by a blank line): some templates (Qwen3.5's) accept a
  system message only at the start, and Codex sends instructions and a developer message both;
  a system or developer message later in the conversation becomes a user message in its place (as
  the Anthropic translation does): a late system message makes Qwen3.5's template raise, and joining
  it to the leading one would change the prompt's start, and every prefix-cache hit, each time;
- a user message is a user message; its text parts are the chat message's text parts;
- consecutive assistant items (reasoning, assistant message, function_call, custom_tool_call) fold
  into one assistant message, as the model wrote them in one turn: reasoning -> reasoning_content,
  text -> content, calls -> tool_calls;
- function_call_output and custom_tool_call_output become tool messages.

Tools: function tools are chat function tools; a `custom` (freeform) tool is offered as a function
with one string parameter `input` (its grammar, if any, written into the description, since the
model cannot see it otherwise), and a call of it is answered as a custom_tool_call with that string
(ember.server.responses.output). Tools only a hosted service runs are left out with a log line.

Invariant: every refusal is a ParamError naming the field (`input[2]`, `tools[0]`, `tool_choice`,
`text`), so a client sees a 400 that says what to change, never a 500.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from ember.errors import ParamError
from ember.server.protocol import ChatCompletionRequest
from ember.server.responses.protocol import (
    ContentPart,
    CustomTool,
    CustomToolCallItem,
    FunctionCallItem,
    FunctionTool,
    InputTokensRequest,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    ToolOutputItem,
)

logger = logging.getLogger("ember.server")

# Tools a hosted service runs (OpenAI's search, code interpreter, ...): ember has nothing to run them
# with, and Codex sends some with every request, so they are left out rather than refused.
HOSTED_TOOLS = frozenset(
    {
        "web_search",
        "web_search_preview",
        "web_search_2025_08_26",
        "web_search_preview_2025_03_11",
        "file_search",
        "namespace",
        "tool_search",
        "image_generation",
        "code_interpreter",
        "computer_use_preview",
        "computer_use",
        "mcp",
        "local_shell",
    }
)
TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
STATELESS = "ember keeps no state between requests: send the whole conversation as input items, with store false"

# The chat fields a chat-side refusal names -> the Responses field the client sent.
CHAT_TO_RESPONSES_PARAM = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
    "reasoning_effort": "reasoning.effort",
}


@dataclass(frozen=True)
class ChatTranslation:
    chat: ChatCompletionRequest
    custom_tools: frozenset[str]  # names of the tools whose calls are answered as custom_tool_call
    tools: list[dict]  # the request's tools as given (hosted ones included): the Response echoes them


def refuse_stateful(req: InputTokensRequest) -> None:
    """A 400 for every field that asks the server to keep or recall state."""
    if req.previous_response_id is not None:
        raise ParamError(f"previous_response_id is not supported: {STATELESS}", "previous_response_id")
    if req.conversation is not None:
        raise ParamError(f"conversation is not supported: {STATELESS}", "conversation")
    if isinstance(req, ResponsesRequest):
        if req.store:  # absent or false: nothing is stored, as Codex asks
            raise ParamError(f"store true is not supported: {STATELESS}", "store")
        if req.background:
            raise ParamError(f"background responses are not supported: {STATELESS}; stream instead", "background")
        if req.prompt is not None:
            raise ParamError(f"stored prompts are not supported: {STATELESS}", "prompt")


def to_chat(req: InputTokensRequest) -> ChatTranslation:
    """The chat request that answers req (a ResponsesRequest, or an InputTokensRequest to count)."""
    refuse_stateful(req)
    if req.text and req.text.get("format") is not None:
        response_format = chat_response_format(req.text["format"])
    else:
        response_format = None
    tools, custom = chat_tools(req.tools or [])
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req.input, req.instructions),
        "tools": tools or None,
        "tool_choice": chat_tool_choice(req.tool_choice, tools),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": response_format,
        "reasoning_effort": reasoning_effort(req.reasoning),
    }
    if isinstance(req, ResponsesRequest):
        body.update(stream=req.stream, max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:  # the items were checked one by one: this names what is still wrong
        raise ParamError(f"the request does not translate to a chat request: {e.errors()[0]['msg']}", "input") from None
    return ChatTranslation(chat, frozenset(custom), list(req.tools or []))


def reasoning_effort(reasoning: dict | None) -> str | None:
    """`reasoning.effort`: the chat request's reasoning_effort (fitted to the template there)."""
    effort = (reasoning or {}).get("effort")
    if effort is not None and not isinstance(effort, str):
        raise ParamError(f"reasoning.effort must be a string such as 'medium', not {effort!r}", "reasoning.effort")
    return effort


# -- input items --------------------------------------------------------------------------------


def _validated(model: type[BaseModel], item: dict, where: str, param: str = "input") -> Any:
    """item as model; its first problem as a 400 that names where it is (`input[2].call_id: ...`)."""
    try:
        return model.model_validate(item)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(x) for x in err.get("loc", ()))
        raise ParamError(f"{where}{'.' + field if field else ''}: {err['msg']}", param) from None


def _part_text(part: ContentPart, where: str) -> str:
    text = part.refusal if part.type == "refusal" else part.text
    if part.type in TEXT_PARTS or part.type == "refusal":
        if text is None:
            raise ParamError(
                f"{where}: a {part.type} part needs its {'refusal' if part.type == 'refusal' else 'text'}", "input"
            )
        return text
    raise ParamError(
        f"{where}: content part type {part.type!r} is not supported: ember serves text models; send input_text parts",
        "input",
    )


def _texts(content: str | list[ContentPart], where: str) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [_part_text(p, f"{where}.content[{i}]") for i, p in enumerate(content)]


class _ChatMessages:
    """Chat messages built item by item; the assistant message being folded stays open until a
    user, system or tool message comes."""

    def __init__(self, instructions: str | None):
        self.messages: list[dict] = []
        self.leading_system: list[str] = [instructions] if instructions else []
        self._assistant: dict | None = None

    def system(self, texts: list[str]) -> None:
        if not self.messages and self._assistant is None:
            self.leading_system.append("\n".join(texts))
        else:
            self._add({"role": "user", "content": _parts(texts)})

    def user(self, texts: list[str]) -> None:
        self._add({"role": "user", "content": _parts(texts)})

    def tool_output(self, call_id: str, texts: list[str]) -> None:
        self._add({"role": "tool", "tool_call_id": call_id, "content": _parts(texts)})

    def assistant_text(self, texts: list[str]) -> None:
        msg = self._open_assistant()
        msg["content"] = (msg["content"] or []) + _parts(texts)

    def assistant_reasoning(self, text: str) -> None:
        msg = self._open_assistant()
        msg["reasoning_content"] = f"{msg['reasoning_content']}\n{text}" if msg.get("reasoning_content") else text

    def assistant_call(self, call_id: str, name: str, arguments: str) -> None:
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
        self._open_assistant().setdefault("tool_calls", []).append(call)

    def finish(self) -> list[dict]:
        self._close_assistant()
        head = [{"role": "system", "content": "\n\n".join(self.leading_system)}] if self.leading_system else []
        return head + self.messages

    def _open_assistant(self) -> dict:
        if self._assistant is None:
            self._assistant = {"role": "assistant", "content": None}
        return self._assistant

    def _close_assistant(self) -> None:
        if self._assistant is not None:
            self.messages.append(self._assistant)
            self._assistant = None

    def _add(self, message: dict) -> None:
        self._close_assistant()
        self.messages.append(message)


def _parts(texts: list[str]) -> list[dict]:
    return [{"type": "text", "text": t} for t in texts]


def _item_kind(item: Any, where: str) -> str:
    if not isinstance(item, dict):
        raise ParamError(f"{where} is not an object", "input")
    kind = item.get("type")
    if kind is None and "role" in item:  # the SDK's EasyInputMessage: a message without a type
        return "message"
    if not isinstance(kind, str):
        raise ParamError(f"{where} has no type", "input")
    return kind


def _add_item(out: _ChatMessages, kind: str, item: dict, where: str) -> None:
    if kind == "message":
        msg = _validated(MessageItem, item, where)
        texts = _texts(msg.content, where)
        if msg.role == "assistant":
            out.assistant_text(texts)
        elif msg.role == "user":
            out.user(texts)
        else:  # system, developer: templates know system; OpenAI ranks the two alike
            out.system(texts)
    elif kind == "function_call":
        call = _validated(FunctionCallItem, item, where)
        out.assistant_call(call.call_id, call.name, call.arguments)
    elif kind == "custom_tool_call":
        call = _validated(CustomToolCallItem, item, where)
        out.assistant_call(call.call_id, call.name, json.dumps({"input": call.input}))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        result = _validated(ToolOutputItem, item, where)
        out.tool_output(result.call_id, _texts(result.output, where))
    elif kind == "reasoning":
        reasoning = _validated(ReasoningItem, item, where)
        text = "\n".join(p.text for p in (reasoning.content or reasoning.summary))
        if text:  # an item with only OpenAI's encrypted_content says nothing ember can read
            out.assistant_reasoning(text)
    elif kind == "item_reference":
        raise ParamError(f"{where}: item_reference is not supported: {STATELESS}", "input")
    else:
        raise ParamError(
            f"{where}: input item type {kind!r} is not supported; ember reads message, function_call, "
            "function_call_output, custom_tool_call, custom_tool_call_output and reasoning items",
            "input",
        )


def chat_messages(items: str | list[dict] | None, instructions: str | None) -> list[dict]:
    """The chat messages of `input` (a string: one user message) after `instructions`."""
    out = _ChatMessages(instructions)
    if isinstance(items, str):
        out.user([items])
    else:
        for i, item in enumerate(items or []):
            where = f"input[{i}]"
            _add_item(out, _item_kind(item, where), item, where)
    messages = out.finish()
    if not messages:
        raise ParamError("the request has no input: give input (a string or items) or instructions", "input")
    return messages


# -- tools, tool_choice, text.format -------------------------------------------------------------


def _custom_as_function(tool: CustomTool) -> dict:
    description = tool.description or ""
    fmt = tool.format
    if fmt is not None and fmt.type == "grammar" and fmt.definition:
        description += f"\n\nThe input is text in this {fmt.syntax or 'lark'} grammar:\n{fmt.definition}"
    return {
        "type": "function",
        "function": {
            "name": tool.name,
            "description": description.strip(),
            "parameters": {
                "type": "object",
                "properties": {"input": {"type": "string", "description": "the raw input text"}},
                "required": ["input"],
            },
        },
    }


def chat_tools(tools: list[Any]) -> tuple[list[dict], set[str]]:
    """(the chat function tools, the names of those that are freeform custom tools)."""
    out: list[dict] = []
    custom: set[str] = set()
    for i, raw in enumerate(tools):
        where = f"tools[{i}]"
        kind = raw.get("type") if isinstance(raw, dict) else None
        if not isinstance(kind, str):
            raise ParamError(f"{where} has no type (function or custom)", "tools")
        if kind in HOSTED_TOOLS:
            logger.info("%s: the hosted tool %r is left out (ember runs no hosted tools)", where, kind)
            continue
        if kind == "function":
            fn = _validated(FunctionTool, raw, where, "tools")
            spec = {"name": fn.name, "description": fn.description, "parameters": fn.parameters, "strict": fn.strict}
            out.append({"type": "function", "function": {k: v for k, v in spec.items() if v is not None}})
        elif kind == "custom":
            tool = _validated(CustomTool, raw, where, "tools")
            out.append(_custom_as_function(tool))
            custom.add(tool.name)
        else:
            raise ParamError(
                f"{where}: tool type {kind!r} is not supported; ember offers function and custom tools "
                f"(hosted tools are left out: {', '.join(sorted(HOSTED_TOOLS))})",
                "tools",
            )
    names = [t["function"]["name"] for t in out]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ParamError(f"tools: more than one tool is named {', '.join(map(repr, dup))}; names must differ", "tools")
    return out, custom


def chat_tool_choice(choice: str | dict | None, tools: list[dict]) -> str | dict | None:
    """auto / none / required as they are; a named function or custom tool -> chat's named function."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        name = choice.get("name")
        names = [t["function"]["name"] for t in tools]
        if not isinstance(name, str) or name not in names:
            raise ParamError(
                f"tool_choice names the tool {name!r}, which is not among the tools offered "
                f"({', '.join(map(repr, names)) or 'none'})",
                "tool_choice",
            )
        return {"type": "function", "function": {"name": name}}
    kind = choice.get("type") if isinstance(choice, dict) else choice
    raise ParamError(
        f"tool_choice {kind!r} is not supported; use auto, none, required, or "
        '{"type": "function", "name": ...} (or "custom" for a custom tool)',
        "tool_choice",
    )


def chat_response_format(fmt: Any) -> dict | None:
    """text.format -> chat's response_format: text is no constraint, json_object any JSON object,
    json_schema that schema (structured outputs)."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ParamError('text.format json_schema needs {"name": ..., "schema": {...}}', "text")
        spec = {"name": fmt.get("name") or "answer", "schema": fmt["schema"], "strict": fmt.get("strict")}
        return {"type": "json_schema", "json_schema": spec}
    raise ParamError(f"text.format type {kind!r} is not one of text, json_object, json_schema", "text")
