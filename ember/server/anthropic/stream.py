"""A streamed chat answer as Anthropic's server-sent events, each `event: NAME\\ndata: JSON\\n\\n`:

    message_start, ping,
    (content_block_start, content_block_delta..., content_block_stop) per block,
    message_delta (stop_reason, stop_sequence, the final usage), message_stop

Deltas are `text_delta`, `thinking_delta` and `input_json_delta` (the pieces of a tool call's arguments
as the model writes them). Blocks open, grow and close as ember.server.chat_blocks says, so the stream
holds the same blocks as the whole answer (message.py).

message_start carries the input usage, so it goes out once the engine's first output is in: that is
when the prefix-cache hit is known (ChatHandler.chunk_dicts yields its first chunk, the role, before it
reads the engine; ctx.cached is set from the second on). A failure after the headers went out is an
`event: error` with Anthropic's error body, never a traceback, and ends the stream.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, AsyncIterator

from ember.errors import EmberError
from ember.server.anthropic.errors import error_event
from ember.server.anthropic.message import opening_block, stop_reason, usage
from ember.server.chat_blocks import TEXT, THINKING, BlockEvent, ChatBlocks

logger = logging.getLogger("ember.server")

# Seconds without an event after which a ping goes out (Anthropic pings a stream that is waiting too).
PING_EVERY = 10.0

_DELTA_FIELDS = {THINKING: ("thinking_delta", "thinking"), TEXT: ("text_delta", "text")}


def sse(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: " + json.dumps(data, separators=(",", ":"), ensure_ascii=False) + "\n\n"


PING = sse("ping", {"type": "ping"})


class MessageEvents:
    """The events of one streamed Message, from the chat path's chunk dicts: start(), feed(chunk) for each
    chunk, finish(). Every method returns the SSE strings to send, in order."""

    def __init__(self, message_id: str, model: str, stop_sequences: list[str]):
        self.message_id, self.model, self.stop_sequences = message_id, model, stop_sequences
        self.blocks = ChatBlocks()
        self.started = False
        self._prompt_tokens = self._cached = 0
        self._matched: Any = None  # the chat choice's stop_reason: the stop string that ended it, if any

    def start(self, prompt_tokens: int, cached: int) -> list[str]:
        self.started = True
        self._prompt_tokens, self._cached = prompt_tokens, cached
        message = {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage(prompt_tokens, 0, cached),
        }
        return [sse("message_start", {"type": "message_start", "message": message}), PING]

    def feed(self, chunk: dict) -> list[str]:
        for choice in chunk.get("choices") or []:
            if choice.get("finish_reason") is not None:
                self._matched = choice.get("stop_reason")
        return [self._event(e) for e in self.blocks.feed_chunk(chunk)]

    def finish(self) -> list[str]:
        """The last block's stop, then message_delta with the stop reason and the whole usage (cumulative,
        as Anthropic sends it: a client overwrites what message_start said), then message_stop."""
        out = [self._event(e) for e in self.blocks.close()]
        reason, sequence = stop_reason(self.blocks.finish_reason, self._matched, self.stop_sequences)
        output_tokens = (self.blocks.usage or {}).get("completion_tokens", 0)
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage(self._prompt_tokens, output_tokens, self._cached),
        }
        return out + [sse("message_delta", delta), sse("message_stop", {"type": "message_stop"})]

    def _event(self, e: BlockEvent) -> str:
        index = e.block.index
        if e.what == "open":
            return sse(
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": opening_block(e.block)},
            )
        if e.what == "close":
            return sse("content_block_stop", {"type": "content_block_stop", "index": index})
        kind, field = _DELTA_FIELDS.get(e.block.kind, ("input_json_delta", "partial_json"))
        return sse(
            "content_block_delta",
            {"type": "content_block_delta", "index": index, "delta": {"type": kind, field: e.delta}},
        )


async def message_stream(
    chunks: AsyncIterator[dict], ctx, events: MessageEvents, ping_every: float = PING_EVERY
) -> AsyncIterator[str]:
    """The SSE text of one answer: chunks from ChatHandler.chunk_dicts(streams, ctx), and a ping whenever
    ping_every seconds pass without one. However this ends (done, failed, the client gone and the response
    cancelled), the chunks are closed, which aborts the engine work."""
    read = 0
    held: list[str] = []
    paced = _paced(chunks, ping_every)
    try:
        async for chunk in paced:
            if chunk is None:
                yield PING
                continue
            read += 1
            lines = events.feed(chunk)
            if read == 1:  # the role chunk, sent before the engine was read: no cache hit known yet
                held = lines
                continue
            if not events.started:  # the engine's first output is in: ctx.cached holds the prefix-cache hit
                lines = events.start(ctx.prompt_len, ctx.cached) + held + lines
            for line in lines:
                yield line
        if not events.started:  # the chunks ended with the first one (no engine output came)
            for line in events.start(ctx.prompt_len, ctx.cached) + held:
                yield line
        for line in events.finish():
            yield line
    except Exception as e:  # noqa: BLE001 -- the headers are sent: report in-band, never a traceback
        logger.exception("anthropic stream %s failed", events.message_id)
        if isinstance(e, EmberError):
            yield error_event(getattr(e, "http_status", 400), str(e))
        else:
            yield error_event(500, "internal error while streaming; see the server log")
    finally:
        await paced.aclose()


async def _paced(chunks: AsyncIterator[dict], every: float) -> AsyncIterator[dict | None]:
    """The chunks, with None in between whenever `every` seconds pass without one (a long prefill: a client
    reading with a timeout, as the SDKs do, would give up on a silent connection). The next chunk is awaited
    in a task of its own, so a pause does not cancel it; however this ends, that task is cancelled first and
    the chunks are closed (closing them aborts the engine work)."""
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(chunks))
            done, _ = await asyncio.wait({pending}, timeout=every)
            if not done:
                yield None
                continue
            got, pending = pending, None
            try:
                chunk = got.result()
            except StopAsyncIteration:
                return
            yield chunk
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await chunks.aclose()
