"""A streamed chat answer (ChatHandler.chunk_dicts) -> the Responses API's server-sent events.

Each event is `event: TYPE` and `data: JSON` (the JSON has `type` and `sequence_number`, counted
from 0), in the order the openai SDK's stream accumulator and Codex expect:

    response.created, response.in_progress
    per output item (ember.server.chat_blocks' blocks, in the order the model wrote them):
      response.output_item.added
      reasoning:  content_part.added, reasoning_text.delta..., reasoning_text.done, content_part.done
      message:    content_part.added, output_text.delta..., output_text.done, content_part.done
      function:   function_call_arguments.delta..., function_call_arguments.done
      custom:     custom_tool_call_input.delta, custom_tool_call_input.done
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

A custom tool's input is the string inside the arguments JSON the model writes, so it is known
when the call closes: it goes out as one delta then. If the engine fails mid-stream the client gets
an `error` event and `response.failed` (with the items done so far); the details go to the log.
A client that goes away closes this generator, which closes the chat stream, which aborts the
engine work.
"""

from __future__ import annotations

import json
import logging
from contextlib import aclosing
from typing import AsyncIterator

from ember.server.chat_blocks import TEXT, THINKING, Block, BlockEvent, ChatBlocks
from ember.server.responses.output import ResponseBuilder

logger = logging.getLogger("ember.server")

STREAM_FAILED = "internal error while streaming; see the server log"


class ResponseEvents:
    """The events of one response, numbered as they are written."""

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder
        self.sequence_number = 0

    def event(self, type_: str, **fields) -> dict:
        e = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return e

    def start(self) -> list[dict]:
        return [
            self.event("response.created", response=self.builder.body()),
            self.event("response.in_progress", response=self.builder.body()),
        ]

    def block_event(self, ev: BlockEvent, finish_reason: str | None = None) -> list[dict]:
        """The events of one block event; finish_reason is the answer's, given for the close at its end."""
        where = {"output_index": ev.block.index}  # every block is one output item, in order
        if ev.what == "open":
            return self._opened(ev.block, where)
        if ev.what == "delta":
            return self._delta(ev.block, ev.delta, where)
        item = self.builder.close(ev.block, finish_reason)
        return self._content_done(ev.block.kind, item, where) + [
            self.event("response.output_item.done", item=item, **where)
        ]

    def _opened(self, block: Block, where: dict) -> list[dict]:
        item = self.builder.item(block)
        out = [self.event("response.output_item.added", item=item, **where)]
        part = self._empty_part(block.kind)
        if part is not None:
            out.append(
                self.event("response.content_part.added", item_id=item["id"], content_index=0, part=part, **where)
            )
        return out

    def _delta(self, block: Block, delta: str, where: dict) -> list[dict]:
        ids = {"item_id": self.builder.item_id(block), **where}
        if block.kind == THINKING:
            return [self.event("response.reasoning_text.delta", content_index=0, delta=delta, **ids)]
        if block.kind == TEXT:
            return [self.event("response.output_text.delta", content_index=0, delta=delta, logprobs=[], **ids)]
        if self.builder.is_custom(block):  # the input is inside JSON text until the call closes (module docstring)
            return []
        return [self.event("response.function_call_arguments.delta", delta=delta, **ids)]

    def _content_done(self, kind: str, item: dict, where: dict) -> list[dict]:
        """What closes an item's content before its output_item.done."""
        ids = {"item_id": item["id"], **where}
        if kind in (THINKING, TEXT):
            part = item["content"][0]
            text_done = "response.reasoning_text.done" if kind == THINKING else "response.output_text.done"
            extra = {} if kind == THINKING else {"logprobs": []}
            return [
                self.event(text_done, content_index=0, text=part["text"], **extra, **ids),
                self.event("response.content_part.done", content_index=0, part=part, **ids),
            ]
        if item["type"] == "custom_tool_call":
            delta = [self.event("response.custom_tool_call_input.delta", delta=item["input"], **ids)]
            return (delta if item["input"] else []) + [
                self.event("response.custom_tool_call_input.done", input=item["input"], **ids)
            ]
        return [self.event("response.function_call_arguments.done", arguments=item["arguments"], **ids)]

    @staticmethod
    def _empty_part(kind: str) -> dict | None:
        if kind == THINKING:
            return {"type": "reasoning_text", "text": ""}
        if kind == TEXT:
            return ResponseBuilder.text_part("")
        return None

    def finish(self, blocks: ChatBlocks, cached: int) -> dict:
        """The last event: the finished Response (blocks.usage: the chat stream's final usage)."""
        usage = blocks.usage
        body = self.builder.final_body(blocks, usage["prompt_tokens"], usage["completion_tokens"], cached)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(body["status"])
        return self.event(kind or "response.failed", response=body)

    def fail(self) -> list[dict]:
        error = {"code": "server_error", "message": STREAM_FAILED}
        return [
            self.event("error", code="server_error", message=STREAM_FAILED, param=None),
            self.event("response.failed", response=self.builder.body("failed", error=error)),
        ]


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


async def response_events(builder: ResponseBuilder, chunks: AsyncIterator[dict], ctx) -> AsyncIterator[str]:
    """The SSE lines of a streamed response. chunks: ChatHandler.chunk_dicts (its last chunk carries
    the usage); ctx: its chat context (ctx.cached: the prefix-cache hit, once the answer has begun)."""
    events = ResponseEvents(builder)
    for e in events.start():
        yield sse(e)
    blocks = ChatBlocks()
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                for ev in blocks.feed_chunk(chunk):
                    for e in events.block_event(ev):
                        yield sse(e)
        for ev in blocks.close():
            for e in events.block_event(ev, blocks.finish_reason):
                yield sse(e)
        yield sse(events.finish(blocks, ctx.cached))
    except Exception:  # noqa: BLE001 -- headers are sent: report in-band, never a traceback
        logger.exception("response stream %s failed", builder.id)
        for e in events.fail():
            yield sse(e)
