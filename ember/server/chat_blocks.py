"""A chat answer as a sequence of blocks: the shape both agent protocols answer in.

Anthropic's Messages API answers in content blocks (`thinking`, `text`, `tool_use`), OpenAI's
Responses API in output items (`reasoning`, `message`, `function_call`). Both open one block, send
its pieces, close it, then open the next. `ChatBlocks` reads what the chat path produces
(ember.server.chat: the chunks of `ChatHandler.chunk_dicts`, or a whole answer's message) and says
when each block opens, grows and closes; ember.server.anthropic and ember.server.responses only
name those events in their own protocol. So the two translations cannot disagree about what the
model said, and a streamed answer and a whole one give the same blocks:

- blocks come in the order the model wrote them; a block closes when a different kind begins (a
  tool call's block when the next call begins), and the last one at the end;
- a text block that would hold only whitespace is never opened (its leading whitespace waits for
  the first visible character): the whole answer's content is None when blank (chat's
  `_take_tool_calls`), so the newlines a model writes between its reasoning and a tool call do not
  become an empty text block in one path and not in the other;
- a tool call's block opens with its id and name and grows by pieces of its arguments JSON text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

THINKING, TEXT, TOOL_CALL = "thinking", "text", "tool_call"


@dataclass
class Block:
    index: int  # its place among the answer's blocks, from 0
    kind: str  # THINKING, TEXT or TOOL_CALL
    text: str = ""  # all of it so far (a tool call's: its arguments JSON text)
    call_id: str = ""  # a tool call's id and function name
    name: str = ""


@dataclass
class BlockEvent:
    what: Literal["open", "delta", "close"]
    block: Block
    delta: str = ""  # the piece a "delta" adds (also already in block.text)


class ChatBlocks:
    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self._open: Block | None = None
        self._held = ""  # leading whitespace of a text block not opened yet
        self._calls: dict[int, Block] = {}  # the chat deltas' tool-call index -> its block

    # -- input --------------------------------------------------------------------------------
    def feed_chunk(self, chunk: dict) -> list[BlockEvent]:
        """One chunk of ChatHandler.chunk_dicts (one choice: these protocols answer with one)."""
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[BlockEvent] = []
        for choice in chunk.get("choices") or []:
            events += self.feed_delta(choice.get("delta") or {})
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def feed_delta(self, delta: dict) -> list[BlockEvent]:
        """One chat delta: reasoning (under either name), content and tool-call pieces, in that order
        (the order the chat path's splitter and parser hand them out in one delta)."""
        events: list[BlockEvent] = []
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if thought:
            events += self._grow(THINKING, thought)
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls") or []:
            events += self._tool_call(call)
        return events

    def feed_message(self, message: dict, finish_reason: str | None, usage: dict | None) -> list[BlockEvent]:
        """A whole answer's assistant message (ChatHandler.whole's choices[0].message), as the one
        delta it would have streamed as; closes the last block."""
        calls = [{**c, "index": i} for i, c in enumerate(message.get("tool_calls") or [])]
        delta = {"reasoning_content": message.get("reasoning_content"), "content": message.get("content")}
        events = self.feed_delta({**delta, "tool_calls": calls})
        self.finish_reason, self.usage = finish_reason, usage
        return events + self.close()

    def close(self) -> list[BlockEvent]:
        """The end of the answer: the open block closes (held whitespace is dropped)."""
        self._held = ""
        return self._close_open()

    # -- blocks -------------------------------------------------------------------------------
    def _text(self, text: str) -> list[BlockEvent]:
        if self._open is not None and self._open.kind == TEXT:
            return self._grow(TEXT, text)
        self._held += text
        if not self._held.strip():
            return []
        text, self._held = self._held, ""
        return self._grow(TEXT, text)

    def _tool_call(self, call: dict) -> list[BlockEvent]:
        fn = call.get("function") or {}
        block = self._calls.get(call.get("index", 0))
        events: list[BlockEvent] = []
        if block is None:  # a call's first delta carries its id and name
            events += self._close_open()
            block = self._new(TOOL_CALL, call_id=call.get("id") or "", name=fn.get("name") or "")
            self._calls[call.get("index", 0)] = block
            events.append(BlockEvent("open", block))
        elif block is not self._open:  # pieces of an earlier call: the chat parser never sends these
            return events
        if fn.get("arguments"):
            block.text += fn["arguments"]
            events.append(BlockEvent("delta", block, fn["arguments"]))
        return events

    def _grow(self, kind: str, text: str) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        if self._open is None or self._open.kind != kind:
            events += self._close_open()
            events.append(BlockEvent("open", self._new(kind)))
        block = self._open
        block.text += text
        events.append(BlockEvent("delta", block, text))
        return events

    def _new(self, kind: str, call_id: str = "", name: str = "") -> Block:
        if kind != TEXT:
            self._held = ""  # whitespace between text and what follows belongs to neither
        block = Block(len(self.blocks), kind, call_id=call_id, name=name)
        self.blocks.append(block)
        self._open = block
        return block

    def _close_open(self) -> list[BlockEvent]:
        block, self._open = self._open, None
        return [BlockEvent("close", block)] if block is not None else []
