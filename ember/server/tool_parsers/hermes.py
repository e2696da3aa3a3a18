"""Qwen / Hermes JSON tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in model text
(Qwen2.5, Qwen3, Qwen3-2507, Qwen3-Next, Hermes models).

A call's arguments are the model's own JSON text of the arguments object, streamed as it is written:
nothing goes out until `{"name": "...", "arguments":` has been read, so a client never sees a call
without its name, and the `}` that may close the outer object is held back until the call ends. A
body that does not start name-first (`{"arguments": ..., "name": ...}`) is parsed whole at its end.
"""

from __future__ import annotations

import json
import re

from ember.server.tool_parsers.framing import Args, BodyEvent, CallEnd, Head, TaggedToolParser

# The head of a call as Qwen and Hermes models write it: name first, then arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')
# What may close the outer object after the arguments value: held back until the call ends.
_TAIL = re.compile(r"\s*\}?\s*$")


class JsonCallBody:
    """One Hermes call body: `{"name": "f", "arguments": {...}}` (a CallBody)."""

    def __init__(self) -> None:
        self._text = ""
        self._name: str | None = None  # set once the head is read (and sent)
        self._args_from = 0  # where the arguments value starts in _text
        self._args_sent = 0  # characters of the arguments text already given out

    def feed(self, text: str) -> list[BodyEvent]:
        self._text += text
        events: list[BodyEvent] = []
        if self._name is None:
            m = _HEAD.match(self._text)
            if m is None:
                return events
            try:
                self._name = json.loads(f'"{m.group(1)}"')
            except json.JSONDecodeError:
                return events
            self._args_from = m.end()
            events.append(Head(self._name))
        raw = self._text[self._args_from :]
        end = _TAIL.search(raw).start()
        if end > self._args_sent:
            events.append(Args(raw[self._args_sent : end]))
            self._args_sent = end
        return events

    def close(self) -> list[BodyEvent] | None:
        if self._name is None:
            parsed = _parse_call(self._text)
            if parsed is None:
                return None
            name, args = parsed
            return [Head(name), Args(args), CallEnd()]
        # _TAIL held back at most the closing brace and blanks, which this drops: what was sent is a prefix
        raw_args = _strip_outer_close(self._text[self._args_from :])
        return [Args(raw_args[self._args_sent :]), CallEnd()]


class HermesToolParser(TaggedToolParser):
    """`--tool-call-parser hermes`: JSON calls in `<tool_call>` tags."""

    XGRAMMAR_FORMAT = "qwen_3"  # <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>

    def new_body(self) -> JsonCallBody:
        return JsonCallBody()


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
    return obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
