"""ember.server.anthropic.message and .stream: a whole chat answer -> a Message, and a recorded stream of
the chat path's chunks -> the exact SSE events (no engine: the chunks are what ChatHandler.chunk_dicts
yields for the answer, written out)."""

from __future__ import annotations

import asyncio
import json

from ember.errors import EngineDeadError
from ember.server.anthropic.message import whole_message
from ember.server.anthropic.stream import MessageEvents, message_stream

HEAD = {"id": "chatcmpl-5eed", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}


def _chunk(delta: dict, finish: str | None = None, stop_reason=None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    if finish is not None:
        choice["stop_reason"] = stop_reason
    return {**HEAD, "choices": [choice], "usage": None}


def _call(index: int, **fn) -> dict:
    return {"tool_calls": [{"index": index, **fn}]}


# thinking, text, a tool call in pieces, as the chat path streams them (role chunk first, usage last)
CHUNKS = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "Paris: "}),
    _chunk({"reasoning_content": "use the tool."}),
    _chunk({"content": "\n\n"}),
    _chunk({"content": "Checking."}),
    _chunk(_call(0, id="call_1", type="function", function={"name": "get_weather", "arguments": ""})),
    _chunk(_call(0, function={"arguments": '{"city": '})),
    _chunk(_call(0, function={"arguments": '"Paris"}'})),
    _chunk({}, finish="tool_calls"),
    {**HEAD, "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52}},
]


class _Ctx:
    """What the stream reads of chat's context: the prompt's length and its prefix-cache hit."""

    prompt_len = 40
    cached = 0


async def _recorded(chunks, ctx, fail: Exception | None = None, closed: list | None = None, prefill: float = 0.0):
    """The chunks as chunk_dicts yields them: the role chunk, then (after the prefill's seconds) the engine's
    output, from which on the prefix-cache hit is known."""
    try:
        for i, c in enumerate(chunks):
            if i == 1:
                await asyncio.sleep(prefill)
                ctx.cached = 32
            yield c
        if fail is not None:
            raise fail
    finally:
        if closed is not None:
            closed.append(True)


def _events(chunks=CHUNKS, ping_every: float = 10.0, **kw) -> list[str]:
    async def run():
        events, ctx = MessageEvents("msg_5eed", "claude-sonnet-4-5", ["END"]), _Ctx()
        return [line async for line in message_stream(_recorded(chunks, ctx, **kw), ctx, events, ping_every)]

    return asyncio.run(run())


def _sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


USAGE = {"input_tokens": 8, "output_tokens": 12, "cache_read_input_tokens": 32, "cache_creation_input_tokens": 0}


def test_a_recorded_stream_gives_exactly_these_events():
    start_usage = {**USAGE, "output_tokens": 0}
    message = {
        "id": "msg_5eed",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": start_usage,
    }

    def delta(i, d):
        return _sse("content_block_delta", {"type": "content_block_delta", "index": i, "delta": d})

    assert _events() == [
        _sse("message_start", {"type": "message_start", "message": message}),
        _sse("ping", {"type": "ping"}),
        _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
        delta(0, {"type": "thinking_delta", "thinking": "Paris: "}),
        delta(0, {"type": "thinking_delta", "thinking": "use the tool."}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse("content_block_start", {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
        delta(1, {"type": "text_delta", "text": "\n\nChecking."}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 1}),
        _sse("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}}),
        delta(2, {"type": "input_json_delta", "partial_json": '{"city": '}),
        delta(2, {"type": "input_json_delta", "partial_json": '"Paris"}'}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 2}),
        _sse("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None}, "usage": USAGE}),
        _sse("message_stop", {"type": "message_stop"}),
    ]  # fmt: skip


def test_a_stop_sequence_and_max_tokens_end_the_stream_with_their_reasons():
    text = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"})]
    usage = {**HEAD, "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2}}
    stopped = _events(text + [_chunk({}, finish="stop", stop_reason="END"), usage])
    assert '"delta":{"stop_reason":"stop_sequence","stop_sequence":"END"}' in stopped[-2]
    cut = _events(text + [_chunk({}, finish="length"), usage])
    assert '"delta":{"stop_reason":"max_tokens","stop_sequence":null}' in cut[-2]
    eos = _events(text + [_chunk({}, finish="stop"), usage])
    assert '"delta":{"stop_reason":"end_turn","stop_sequence":null}' in eos[-2]


def test_a_failure_mid_stream_is_an_error_event_and_the_chunks_are_closed():
    closed: list = []
    lines = _events(CHUNKS[:5], fail=RuntimeError("kaboom"), closed=closed)
    assert lines[0].startswith("event: message_start") and closed == [True]
    assert lines[-1] == _sse(
        "error",
        {
            "type": "error",
            "error": {"type": "api_error", "message": "internal error while streaming; see the server log"},
        },
    )
    assert "kaboom" not in "".join(lines)  # details go to the log only
    dead = _events(CHUNKS[:2], fail=EngineDeadError("the engine has shut down"))
    assert json.loads(dead[-1].split("data: ", 1)[1])["error"] == {
        "type": "overloaded_error",
        "message": "the engine has shut down",
    }


def test_a_long_prefill_is_kept_alive_with_pings_and_changes_nothing_else():
    paced = _events(ping_every=0.02, prefill=0.3)
    pings = paced.index(_events()[0])  # the pings that went out before message_start
    assert pings >= 3 and set(paced[:pings]) == {_sse("ping", {"type": "ping"})}
    assert paced[pings:] == _events()


def test_a_client_gone_mid_prefill_closes_the_chunks():
    """Starlette cancels the response's task when the client hangs up: the chunks (whose closing aborts the
    engine work) are closed, also while the next chunk is awaited in its own task."""
    closed: list = []

    async def run():
        ctx = _Ctx()
        stream = message_stream(
            _recorded(CHUNKS, ctx, closed=closed, prefill=30), ctx, MessageEvents("m", "c", []), 0.01
        )

        async def consume():
            async for _ in stream:
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert closed == [True]  # now, not when asyncio.run finalizes what was left open

    asyncio.run(run())


def test_the_whole_answer_is_the_same_blocks_as_a_message():
    answer = {
        "id": "chatcmpl-5eed",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "\n\nChecking.",
                    "reasoning_content": "Paris: use the tool.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                        }
                    ],
                },
                "finish_reason": "tool_calls",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52},
    }
    assert whole_message(answer, model="claude-sonnet-4-5", cached=32, stop_sequences=[]) == {
        "id": "msg_5eed",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [
            {"type": "thinking", "thinking": "Paris: use the tool.", "signature": ""},
            {"type": "text", "text": "\n\nChecking."},
            {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": USAGE,
    }  # fmt: skip


def test_a_whole_answer_with_a_stop_sequence_and_broken_arguments(caplog):
    answer = {
        "id": "chatcmpl-1",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "Hi",
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1'}}],
                },
                "finish_reason": "stop",
                "stop_reason": "END",
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
    }
    got = whole_message(answer, model="m", cached=0, stop_sequences=["END"])
    assert (got["stop_reason"], got["stop_sequence"]) == ("stop_sequence", "END")
    assert got["content"][1]["input"] == {} and "no JSON object" in caplog.text  # said, not silently dropped
    assert got["usage"] == {
        "input_tokens": 5,
        "output_tokens": 3,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }


def test_the_anthropic_sdk_reads_the_recorded_stream_into_the_same_message():
    """The SDK's own stream accumulator, over the events above served by a mock transport (no server)."""
    import anthropic
    import httpx2  # the transport the anthropic SDK is built on

    body = "".join(_events()).encode()
    transport = httpx2.MockTransport(
        lambda request: httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=body)
    )
    client = anthropic.Anthropic(
        api_key="k", base_url="http://ember.test", http_client=httpx2.Client(transport=transport)
    )
    with client.messages.stream(
        model="claude-sonnet-4-5", max_tokens=64, messages=[{"role": "user", "content": "?"}]
    ) as s:
        got = s.get_final_message()
    assert [b.type for b in got.content] == ["thinking", "text", "tool_use"]
    assert got.content[2].input == {"city": "Paris"} and got.stop_reason == "tool_use"
    assert (got.usage.input_tokens, got.usage.cache_read_input_tokens, got.usage.output_tokens) == (8, 32, 12)
