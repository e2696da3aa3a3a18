"""Qwen / Hermes tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in model text.

One parser serves both paths. `HermesToolParser.feed(text)` takes text deltas as the model
writes them and returns what a client may see now: content deltas and tool-call deltas in
OpenAI's streaming shape (the first delta of a call carries index, id, type and the function
name; later ones carry pieces of `arguments`). `finish()` flushes the rest. The non-streaming
answer is the same parser fed the whole text at once, so both paths agree to the byte: the
concatenated `arguments` pieces are the model's own JSON text of the arguments object.

Text that could still be the start of `<tool_call>` is held back until it is decided, and
inside a call nothing is sent until `{"name": "...", "arguments":` has been read, so a client
never sees half a tag or a call without its name.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ember.structured.reasoning import partial_suffix

START = "<tool_call>"
END = "</tool_call>"

# The head of a call as Qwen and Hermes models write it: name first, then arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may close the outer object after the arguments value: held back until the call ends.
_TAIL = re.compile(r"\s*\}?\s*$")


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ParsedDelta:
    content: str = ""
    # OpenAI streaming tool-call deltas: {"index", "id", "type", "function": {"name", "arguments"}}
    tool_calls: list[dict] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class HermesToolParser:
    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.content = ""  # all content handed out
        self._buf = ""  # text received, not yet decided
        self._in_call = False
        self._body = ""  # the current call's text after <tool_call>
        self._head_sent = False
        self._args_sent = 0  # characters of the raw arguments text already sent
        self._call_id = ""
        self._name = ""

    # -- streaming ----------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf:
            if not self._in_call:
                at = self._buf.find(START)
                if at == -1:
                    keep = partial_suffix(self._buf, START)
                    self._emit_content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._emit_content(out, self._buf[:at])
                self._buf = self._buf[at + len(START) :]
                self._open_call()
            else:
                at = self._buf.find(END)
                if at == -1:
                    keep = partial_suffix(self._buf, END)
                    self._body += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    self._stream_call(out)
                    break
                self._body += self._buf[:at]
                self._buf = self._buf[at + len(END) :]
                self._close_call(out)
        return out

    def finish(self) -> ParsedDelta:
        """The model stopped: flush held-back text; an unclosed call is closed if its JSON parses."""
        out = ParsedDelta()
        if self._in_call:
            self._body += self._buf
            self._buf = ""
            if self._head_sent or _parse_call(self._body) is not None:
                self._close_call(out)
            else:  # not a tool call after all: show the text as it was written
                self._in_call = False
                self._emit_content(out, START + self._body)
        elif self._buf:
            self._emit_content(out, self._buf)
            self._buf = ""
        return out

    # -- internals ----------------------------------------------------------------------------
    def _emit_content(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if self.calls or self._in_call:
            # Between or after calls only whitespace is expected; anything else is still content.
            if not text.strip():
                return
        out.content += text
        self.content += text

    def _open_call(self) -> None:
        self._in_call = True
        self._body = ""
        self._head_sent = False
        self._args_sent = 0
        self._call_id = new_call_id()
        self._name = ""

    def _stream_call(self, out: ParsedDelta) -> None:
        if not self._head_sent:
            m = _HEAD.match(self._body)
            if m is None:
                return
            try:
                self._name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return
            self._head_sent = True
            self._args_from = m.end()
            out.tool_calls.append(
                {
                    "index": len(self.calls),
                    "id": self._call_id,
                    "type": "function",
                    "function": {"name": self._name, "arguments": ""},
                }
            )
        raw = self._body[self._args_from :]
        tail = _TAIL.search(raw)
        end = tail.start() if tail else len(raw)
        if end > self._args_sent:
            self._send_args(out, raw[self._args_sent : end])
            self._args_sent = end

    def _send_args(self, out: ParsedDelta, piece: str) -> None:
        index = len(self.calls)
        if out.tool_calls and out.tool_calls[-1]["index"] == index:
            out.tool_calls[-1]["function"]["arguments"] += piece
        else:
            out.tool_calls.append({"index": index, "function": {"arguments": piece}})

    def _close_call(self, out: ParsedDelta) -> None:
        self._in_call = False
        if not self._head_sent:
            parsed = _parse_call(self._body)
            if parsed is None:  # not a well-formed call: keep the text as content
                self._emit_content(out, START + self._body + END)
                return
            name, args = parsed
            index = len(self.calls)
            out.tool_calls.append(
                {"index": index, "id": self._call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
            self.calls.append(ToolCall(self._call_id, name, args))
            return
        raw = self._body[self._args_from :]
        raw_args = _strip_outer_close(raw)
        if len(raw_args) > self._args_sent:
            self._send_args(out, raw_args[self._args_sent :])
        self.calls.append(ToolCall(self._call_id, self._name, raw_args))
        self._head_sent = False


def _strip_outer_close(raw: str) -> str:
    """The arguments text without the `}` that closes the call object (and whitespace)."""
    text = raw.rstrip()
    if text.endswith("}"):
        candidate = text[:-1].rstrip()
        try:  # only drop the brace when what is left is the whole arguments value
            json.loads(candidate)
            return candidate
        except json.JSONDecodeError:
            pass
    return text


def _parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a whole call body, or None when it is not one."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    m = _HEAD.match(body)
    if m is not None:  # name first, arguments second: keep the model's own text
        raw = _strip_outer_close(body[m.end() :])
        try:
            if json.loads(raw) == args:
                return obj["name"], raw
        except json.JSONDecodeError:
            pass
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Non-streaming: (content or None, tool calls) of a whole model output."""
    parser = HermesToolParser()
    parser.feed(text)
    parser.finish()
    if not parser.calls:
        return text, []
    content = parser.content if parser.content.strip() else None
    return content, parser.calls
