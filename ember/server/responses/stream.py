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

from ember.server.chat_blocks import TEXT, THINKING, BlockEvent, ChatBlocks
from ember.server.responses.output import ResponseBuilder

logger = logging.getLogger("ember.server")

STREAM_FAILED = "internal error while streaming; see the server log"


class ResponseEvents:
    """The events of one response, numbered as they are written."""

    def __init__(self, builder: ResponseBuilder):
        self.builder = builder
        self.sequence_number = 0
        self._output_index: dict[int, int] = {}  # block index -> its item's place in the output

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
        """The events of one block event; finish_reason is the answer's, given for the closes at its end."""
        block = ev.block
        if ev.what == "open":
            self._output_index[block.index] = len(self._output_index)
        where = {"output_index": self._output_index[block.index]}
        if ev.what == "open":
            item = self.builder.item(block)
            out = [self.event("response.output_item.added", item=item, **where)]
            part = self._empty_part(block.kind)
            if part is not None:
                out.append(
                    self.event("response.content_part.added", item_id=item["id"], content_index=0, part=part, **where)
                )
            return out
        item_id = self.builder.item_id(block)
        if ev.what == "delta":
            return self._delta(block.kind, self.builder.is_custom(block), item_id, ev.delta, where)
        done = self.builder.close(block, finish_reason)
        return self._done_events(block.kind, done, where) + [
            self.event("response.output_item.done", item=done, **where)
        ]

    def _delta(self, kind: str, custom: bool, item_id: str, delta: str, where: dict) -> list[dict]:
        if kind == THINKING:
            return [self.event("response.reasoning_text.delta", item_id=item_id, content_index=0, delta=delta, **where)]
        if kind == TEXT:
            return [
                self.event(
                    "response.output_text.delta", item_id=item_id, content_index=0, delta=delta, logprobs=[], **where
                )
            ]
        if custom:  # the input is inside JSON text until the call closes (see the module docstring)
            return []
        return [self.event("response.function_call_arguments.delta", item_id=item_id, delta=delta, **where)]

    def _done_events(self, kind: str, item: dict, where: dict) -> list[dict]:
        """What closes an item's content before its output_item.done."""
        ids = {"item_id": item["id"], **where}
        if kind == THINKING:
            text = item["content"][0]["text"]
            return [
                self.event("response.reasoning_text.done", content_index=0, text=text, **ids),
                self.event("response.content_part.done", content_index=0, part=item["content"][0], **ids),
            ]
        if kind == TEXT:
            part = item["content"][0]
            return [
                self.event("response.output_text.done", content_index=0, text=part["text"], logprobs=[], **ids),
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
