"""ember.server.chat_blocks: chat deltas -> blocks, the same for a streamed answer and a whole one."""

from ember.server.chat_blocks import TEXT, THINKING, TOOL_CALL, ChatBlocks


def _chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": usage}


CALL_ID = "call_abc"
STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "The user wants "}),
    _chunk({"reasoning_content": "weather."}),
    _chunk({"content": "\n\n"}),
    _chunk(
        {
            "tool_calls": [
                {"index": 0, "id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": ""}}
            ]
        }
    ),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
    _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
    _chunk(
        {
            "tool_calls": [
                {"index": 1, "id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "{}"}}
            ]
        }
    ),
    _chunk({}, finish="tool_calls"),
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}},
]


def _shape(blocks) -> list[tuple]:
    return [(b.index, b.kind, b.text, b.call_id, b.name) for b in blocks]


def test_a_stream_opens_grows_and_closes_each_block_in_order():
    blocks = ChatBlocks()
    events = [e for c in STREAM for e in blocks.feed_chunk(c)] + blocks.close()
    assert _shape(blocks.blocks) == [
        (0, THINKING, "The user wants weather.", "", ""),
        (1, TOOL_CALL, '{"city": "Paris"}', CALL_ID, "get_weather"),
        (2, TOOL_CALL, "{}", "call_2", "noop"),
    ]  # the blank text between reasoning and the call opened no block
    assert [(e.what, e.block.index) for e in events] == [
        ("open", 0), ("delta", 0), ("delta", 0), ("close", 0),
        ("open", 1), ("delta", 1), ("delta", 1), ("close", 1),
        ("open", 2), ("delta", 2), ("close", 2),
    ]  # fmt: skip
    assert blocks.finish_reason == "tool_calls" and blocks.usage == {"prompt_tokens": 5, "completion_tokens": 9}


def test_the_whole_message_gives_the_same_blocks_as_its_stream():
    streamed = ChatBlocks()
    for c in STREAM:
        streamed.feed_chunk(c)
    streamed.close()
    message = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "The user wants weather.",
        "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
        ],
    }
    whole = ChatBlocks()
    events = whole.feed_message(message, "tool_calls", {"prompt_tokens": 5})
    assert _shape(whole.blocks) == _shape(streamed.blocks)
    assert events[-1].what == "close" and whole.finish_reason == "tool_calls"


def test_text_keeps_its_inner_whitespace_and_reasoning_may_come_under_either_name():
    blocks = ChatBlocks()
    for d in ({"reasoning": "hmm"}, {"content": "  "}, {"content": "Hi"}, {"content": "\n\nthere"}):
        blocks.feed_delta(d)
    blocks.close()
    assert _shape(blocks.blocks) == [(0, THINKING, "hmm", "", ""), (1, TEXT, "  Hi\n\nthere", "", "")]


def test_trailing_whitespace_only_text_opens_nothing():
    blocks = ChatBlocks()
    events = blocks.feed_delta({"content": "\n"}) + blocks.close()
    assert events == [] and blocks.blocks == []
