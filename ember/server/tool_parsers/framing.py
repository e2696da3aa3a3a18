"""`<tool_call>` ... `</tool_call>` in model text: what every Qwen-family tool-call format shares.

`TaggedToolParser.feed(text)` takes text deltas as the model writes them and returns what a client
may see now: content deltas and tool-call deltas in OpenAI's streaming shape. `finish()` flushes the
rest. The text between the tags (a call's body) is read by a `CallBody` of the parser's own format
(Hermes JSON: hermes.py, Qwen3-Coder XML: qwen3_xml.py), which reports what it has read as events:
a call's head (its name), pieces of its arguments, its end. This class numbers the calls, gives
them ids and turns the events into deltas.

Invariants every parser built on it keeps:
- Streamed equals whole: the whole answer is the same parser fed the whole text at once, and a
  call's `arguments` is the concatenation of the pieces streamed for it, so both agree to the byte.
- Text that could still be the start of `<tool_call>` or `</tool_call>` is held back until decided,
  so a client never sees half a tag.
- A call's head delta (index, id, type, name, arguments "") goes out once, before any piece of its
  arguments.
- A body that turns out not to be a call (none of it sent yet) goes out as content, as written.
- Between and after calls, blank content is dropped (the newlines around the tags).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Union

from ember.server.tool_parsers.calls import ParsedDelta, ToolCall, new_call_id
from ember.structured.reasoning import partial_suffix

START = "<tool_call>"
END = "</tool_call>"


@dataclass
class Head:
    """A call begins: its function's name is known."""

    name: str


@dataclass
class Args:
    """More of the current call's arguments text."""

    text: str


@dataclass
class CallEnd:
    """The current call is complete."""


BodyEvent = Union[Head, Args, CallEnd]


class CallBody(Protocol):
    """Reads one call body (the text between `<tool_call>` and `</tool_call>`), fed in pieces."""

    def feed(self, text: str) -> list[BodyEvent]:
        """Events for what this piece completes; text that is not decided yet is held."""

    def close(self) -> list[BodyEvent] | None:
        """The body has ended (at `</tool_call>`, or the model stopped): the remaining events, every
        call it began ended; None when the body was no call at all (only when it gave no Head)."""


class TaggedToolParser:
    """The framing of calls in `<tool_call>` tags; a subclass says how a body is read (new_body).

    tools: the request's tools in OpenAI's shape, for formats whose values are typed by the schema."""

    # xgrammar's builtin structural tag that writes this format: what tool_choice "required" or a
    # named function holds the answer to (ember.structured.tool_calls), so that a forced call is
    # written the way the model was trained to write calls
    XGRAMMAR_FORMAT: str
    # tags that end a thinking model's reasoning when they come before `</think>` (Qwen3.5 may open a
    # call inside its think block): handed to the reasoning splitter of a request with tools
    ENDS_REASONING = (START,)

    def __init__(self, tools: list[dict] | None = None) -> None:
        self.tools = tools or []
        self.calls: list[ToolCall] = []
        self.content = ""  # all content handed out
        self._buf = ""  # text received, not yet decided
        self._body: CallBody | None = None  # inside <tool_call>: the reader of its body
        self._raw = ""  # the current body's text as written, given back as content if it is no call
        self._open: ToolCall | None = None  # the call whose arguments are being streamed

    def new_body(self) -> CallBody:
        raise NotImplementedError

    # -- streaming ----------------------------------------------------------------------------
    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._buf += text
        while self._buf:
            if self._body is None:
                at = self._buf.find(START)
                if at == -1:
                    keep = partial_suffix(self._buf, START)
                    self._emit_content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._emit_content(out, self._buf[:at])
                self._buf = self._buf[at + len(START) :]
                self._body, self._raw = self.new_body(), ""
            else:
                at = self._buf.find(END)
                if at == -1:
                    keep = partial_suffix(self._buf, END)
                    self._feed_body(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._feed_body(out, self._buf[:at])
                self._buf = self._buf[at + len(END) :]
                self._close_body(out, closed=True)
        return out

    def finish(self) -> ParsedDelta:
        """The model stopped: held-back text goes out; an unclosed call ends where the text does."""
        out = ParsedDelta()
        if self._body is not None:
            rest, self._buf = self._buf, ""
            self._feed_body(out, rest)
            self._close_body(out, closed=False)
        elif self._buf:
            self._emit_content(out, self._buf)
            self._buf = ""
        return out

    # -- internals ----------------------------------------------------------------------------
    def _emit_content(self, out: ParsedDelta, text: str) -> None:
        if not text:
            return
        if (self.calls or self._body is not None) and not text.strip():
            return  # between or after calls only blank text is expected; anything else is still content
        out.content += text
        self.content += text

    def _feed_body(self, out: ParsedDelta, text: str) -> None:
        if text:
            self._raw += text
            self._apply(out, self._body.feed(text))

    def _close_body(self, out: ParsedDelta, closed: bool) -> None:
        body, self._body = self._body, None
        events = body.close()
        if events is None:  # no call after all: the text as the model wrote it
            self._emit_content(out, START + self._raw + (END if closed else ""))
            return
        self._apply(out, events)
        if self._open is not None:  # a body that forgot to end its call: it ends with the body
            self._apply(out, [CallEnd()])

    def _apply(self, out: ParsedDelta, events: list[BodyEvent]) -> None:
        for event in events:
            if isinstance(event, Head):
                self._open = ToolCall(new_call_id(), event.name, "")
                out.tool_calls.append(
                    {
                        "index": len(self.calls),
                        "id": self._open.id,
                        "type": "function",
                        "function": {"name": event.name, "arguments": ""},
                    }
                )
            elif isinstance(event, Args):
                if event.text:
                    self._send_args(out, event.text)
            else:
                self.calls.append(self._open)
                self._open = None

    def _send_args(self, out: ParsedDelta, piece: str) -> None:
        self._open.arguments += piece
        index = len(self.calls)
        if out.tool_calls and out.tool_calls[-1]["index"] == index:
            out.tool_calls[-1]["function"]["arguments"] += piece
        else:
            out.tool_calls.append({"index": index, "function": {"arguments": piece}})


def parse_whole(parser: TaggedToolParser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole model output through a fresh parser: (content, None when blank beside calls; the calls)."""
    parser.feed(text)
    parser.finish()
    if not parser.calls:
        return text, []
    return (parser.content if parser.content.strip() else None), parser.calls
