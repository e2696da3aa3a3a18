"""Qwen3-Coder XML tool calls, the form Qwen3.5, Qwen3.6, Qwen3-Coder and Qwen3-Coder-Next write
(vLLM's and SGLang's `qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A call's arguments go out as JSON built from the parameters: `{` and the first `"name": value`
when that parameter is finished, `, "name": value` for each later one, `}` at `</function>` (`{}`
for a call without parameters), so the concatenated pieces are one JSON object. A value is its text
with exactly one leading and one trailing newline stripped, typed by the request's tool schema
(values.py). The head delta goes out as soon as `<function=NAME>` is complete.

Lenient, because models drift: a missing `</parameter>` ends at the next `<parameter=` or at
`</function>`, a missing `</function>` at `</tool_call>` or the end of the output (where a tag cut
off by max_tokens is no part of the value); several `<function=` blocks in one `<tool_call>` are
several calls; text around them is dropped; and a body that starts with `{` is a Hermes JSON call
(small Qwen3.5 sizes write either form). Nothing here raises on odd text: the worst outcome is a
call's value kept as a string, or a body shown as content.
"""

from __future__ import annotations

import json
from typing import Any

from ember.server.tool_parsers.framing import Args, BodyEvent, CallBody, CallEnd, Head, TaggedToolParser
from ember.server.tool_parsers.hermes import JsonCallBody
from ember.server.tool_parsers.values import parameter_schemas, typed_value
from ember.structured.reasoning import partial_suffix

FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"

# What the reader is looking for next.
_SEEK_FUNCTION, _FUNCTION_NAME, _SEEK_PARAMETER, _PARAMETER_NAME, _VALUE = range(5)


class XmlCallBody:
    """One `<tool_call>` body of `<function=...>` blocks (a CallBody).

    Invariant: `_buf` never holds text that could be dropped or sent already, only what is undecided:
    the tail that may still become a tag, an unfinished name, or a value still being written (`_value`
    holds the value's text before the tail)."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self._schemas = schemas
        self._buf = ""
        self._state = _SEEK_FUNCTION
        self._functions = 0  # functions begun in this body
        self._function = ""  # the open function's name
        self._params_sent = 0  # parameters of the open function given out
        self._parameter = ""  # the name of the parameter whose value is being read
        self._value = ""  # that value's text so far, up to the undecided tail in _buf

    def feed(self, text: str) -> list[BodyEvent]:
        self._buf += text
        return self._read(final=False)

    def close(self) -> list[BodyEvent] | None:
        events = self._read(final=True)
        return events if self._functions else None

    def _read(self, final: bool) -> list[BodyEvent]:
        """Events for everything decided in _buf; with final, the text has ended and all is decided."""
        events: list[BodyEvent] = []
        while True:
            if self._state == _SEEK_FUNCTION:
                if not self._skip_to((FUNCTION,), final):
                    return events
                self._state = _FUNCTION_NAME
            elif self._state == _FUNCTION_NAME:
                name = self._name(final)
                if name is None:
                    return events
                self._state, self._function, self._params_sent = _SEEK_PARAMETER, name, 0
                self._functions += 1
                events.append(Head(name))
            elif self._state == _SEEK_PARAMETER:
                found = self._skip_to((PARAMETER, FUNCTION_END), final)
                if found == PARAMETER:
                    self._state = _PARAMETER_NAME
                else:
                    if found is None and not final:
                        return events
                    events += self._end_function()  # at </function>, or where the text ends
                    self._state = _SEEK_FUNCTION
            elif self._state == _PARAMETER_NAME:
                name = self._name(final)
                if name is None:
                    if final:  # `<parameter=na` cut off: the function still ends
                        self._state = _SEEK_PARAMETER
                        continue
                    return events
                self._state, self._parameter, self._value = _VALUE, name, ""
            else:
                if not self._read_value(final):
                    return events
                events.append(Args(self._parameter_json()))
                self._state = _SEEK_PARAMETER

    def _skip_to(self, tags: tuple[str, ...], final: bool) -> str | None:
        """Drop text up to the first of tags and the tag itself; which tag, or None (the undecided
        tail kept, unless final)."""
        found = _first_of(self._buf, tags)
        if found is None:
            keep = 0 if final else max(partial_suffix(self._buf, tag) for tag in tags)
            self._buf = self._buf[len(self._buf) - keep :]
            return None
        at, tag = found
        self._buf = self._buf[at + len(tag) :]
        return tag

    def _name(self, final: bool) -> str | None:
        """A `<function=` or `<parameter=` name up to its `>`, consumed; None while unfinished (at
        the end of the text an unfinished name is dropped). A name cut by a newline before any `>`
        ends there (the `>` forgotten); the newline stays, as the one a value starts with."""
        found = _first_of(self._buf, (">", "\n"))
        if found is None:
            if final:
                self._buf = ""
            return None
        at, tag = found
        name = self._buf[:at].strip()
        self._buf = self._buf[at + 1 :] if tag == ">" else self._buf[at:]
        return name

    def _read_value(self, final: bool) -> bool:
        """Whether the value is complete: at `</parameter>` (consumed), or at a `<parameter=` or
        `</function>` that begins without it (left for the next state), or at the end of the text. A
        text that ends in part of a tag (`</param`: the output was cut off there) ends the value
        before it."""
        found = _first_of(self._buf, (PARAMETER_END, PARAMETER, FUNCTION_END))
        if found is None:
            keep = max(partial_suffix(self._buf, t) for t in (PARAMETER_END, PARAMETER, FUNCTION_END))
            self._value += self._buf[: len(self._buf) - keep]
            self._buf = "" if final else self._buf[len(self._buf) - keep :]
            return final
        at, tag = found
        self._value += self._buf[:at]
        self._buf = self._buf[at + len(tag) :] if tag == PARAMETER_END else self._buf[at:]
        return True

    def _parameter_json(self) -> str:
        """The finished parameter as its piece of the arguments object."""
        text = self._value
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        schema = self._schemas.get(self._function, {}).get(self._parameter)
        value = typed_value(text, schema)
        lead = "{" if self._params_sent == 0 else ", "
        self._params_sent += 1
        return lead + json.dumps(self._parameter, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)

    def _end_function(self) -> list[BodyEvent]:
        return [Args("}" if self._params_sent else "{}"), CallEnd()]


class XmlOrJsonBody:
    """A `<tool_call>` body read as XML, or as Hermes JSON when its first non-blank character is `{`
    (a CallBody). Nothing is read until that character has arrived."""

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self._schemas = schemas
        self._lead = ""  # blank text before the deciding character
        self._body: CallBody | None = None

    def feed(self, text: str) -> list[BodyEvent]:
        if self._body is None:
            self._lead += text
            if not self._lead.strip():
                return []
            text, self._lead = self._lead, ""
            self._body = JsonCallBody() if text.lstrip().startswith("{") else XmlCallBody(self._schemas)
        return self._body.feed(text)

    def close(self) -> list[BodyEvent] | None:
        return None if self._body is None else self._body.close()


class Qwen3XmlToolParser(TaggedToolParser):
    """`--tool-call-parser qwen3_coder` (or `qwen3_xml`): XML calls in `<tool_call>` tags, typed by
    the request's tools."""

    # xgrammar registers "qwen_3_5" and "qwen_3_coder" for this one format (its Qwen XML tag: values
    # held to the tool's schema in its qwen_xml style)
    XGRAMMAR_FORMAT = "qwen_3_5"

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._schemas = parameter_schemas(self.tools)

    def new_body(self) -> XmlOrJsonBody:
        return XmlOrJsonBody(self._schemas)


def _first_of(text: str, tags: tuple[str, ...]) -> tuple[int, str] | None:
    """(position, tag) of the earliest of tags in text, or None."""
    hits = [(at, tag) for tag in tags if (at := text.find(tag)) != -1]
    return min(hits) if hits else None
