"""ember.server.responses.output and .stream: a chat answer -> the Response object and its SSE events.

A recorded chat chunk stream (reasoning, text, a function call, a custom tool call) must give the
exact event list, ids equal wherever an item appears, every event and the final Response valid under
the openai SDK's own types, and the SDK's stream accumulator must end with the same Response as the
whole answer of the same message."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import openai
import pytest
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from ember.server.responses.output import ResponseBuilder, custom_tool_input, whole_response
from ember.server.responses.protocol import ResponsesRequest
from ember.server.responses.stream import response_events
from ember.server.responses.translate import to_chat

TOOLS = [
    {"type": "function", "name": "get_weather", "parameters": {"type": "object"}},
    {
        "type": "custom",
        "name": "apply_patch",
        "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
    },
    {"type": "web_search"},
]
PATCH = "*** Begin Patch\n*** End Patch"
USAGE = {"prompt_tokens": 20, "completion_tokens": 30, "total_tokens": 50}


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}], "usage": None}


def _call(index: int, call_id: str | None, name: str | None, args: str) -> dict:
    call: dict = {"index": index, "function": {"arguments": args}}
    if call_id is not None:
        call.update(id=call_id, type="function", function={"name": name, "arguments": args})
    return _chunk({"tool_calls": [call]})


ARGS_PATCH = json.dumps({"input": PATCH})
STREAM = [
    _chunk({"role": "assistant", "content": ""}),
    _chunk({"reasoning_content": "Think "}),
    _chunk({"reasoning_content": "twice."}),
    _chunk({"content": "\n\nHere"}),
    _chunk({"content": " we go."}),
    _call(0, "call_w", "get_weather", ""),
    _call(0, None, None, '{"city": '),
    _call(0, None, None, '"Paris"}'),
    _call(1, "call_p", "apply_patch", ARGS_PATCH[:12]),
    _call(1, None, None, ARGS_PATCH[12:]),
    _chunk({}, finish="tool_calls"),
    {"choices": [], "usage": USAGE},
]
# the same answer, whole (ChatHandler.whole's shape)
MESSAGE = {
    "role": "assistant",
    "content": "\n\nHere we go.",
    "reasoning_content": "Think twice.",
    "tool_calls": [
        {"id": "call_w", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_p", "type": "function", "function": {"name": "apply_patch", "arguments": ARGS_PATCH}},
    ],
}


def builder(**body) -> ResponseBuilder:
    req = ResponsesRequest.model_validate({"input": "hi", "tools": TOOLS, **body})
    return ResponseBuilder(req, to_chat(req), "resp_x", 1700000000, "tiny", lambda text: len(text.split()))


async def _chunks(chunks: list[dict], fail_after: int | None = None, closed: list | None = None):
    try:
        for i, c in enumerate(chunks):
            if i == fail_after:
                raise RuntimeError("engine failed")
            yield c
    finally:
        if closed is not None:
            closed.append(True)


def stream(chunks: list[dict], b: ResponseBuilder | None = None, fail_after: int | None = None) -> list[dict]:
    """The events of a chat chunk stream, parsed back from their SSE lines (which must be well formed)."""

    async def run() -> list[str]:
        ctx = SimpleNamespace(cached=4)
        return [line async for line in response_events(b or builder(), _chunks(chunks, fail_after), ctx)]

    events = []
    for line in asyncio.run(run()):
        head, data, blank = line.split("\n", 2)
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}" and blank == "\n"
        events.append(event)
    return events


def shape(events: list[dict]) -> list[tuple]:
    """(type, output_index, the item type or the delta) of each event."""
    out = []
    for e in events:
        detail = e.get("item", {}).get("type") or e.get("delta") or e.get("part", {}).get("type")
        out.append((e["type"], e.get("output_index"), detail))
    return out


def test_a_recorded_stream_gives_the_exact_event_list():
    events = stream(STREAM)
    assert shape(events) == [
        ("response.created", None, None),
        ("response.in_progress", None, None),
        ("response.output_item.added", 0, "reasoning"),
        ("response.content_part.added", 0, "reasoning_text"),
        ("response.reasoning_text.delta", 0, "Think "),
        ("response.reasoning_text.delta", 0, "twice."),
        ("response.reasoning_text.done", 0, None),
        ("response.content_part.done", 0, "reasoning_text"),
        ("response.output_item.done", 0, "reasoning"),
        ("response.output_item.added", 1, "message"),
        ("response.content_part.added", 1, "output_text"),
        ("response.output_text.delta", 1, "\n\nHere"),  # the text's leading newlines waited for "Here"
        ("response.output_text.delta", 1, " we go."),
        ("response.output_text.done", 1, None),
        ("response.content_part.done", 1, "output_text"),
        ("response.output_item.done", 1, "message"),
        ("response.output_item.added", 2, "function_call"),
        ("response.function_call_arguments.delta", 2, '{"city": '),
        ("response.function_call_arguments.delta", 2, '"Paris"}'),
        ("response.function_call_arguments.done", 2, None),
        ("response.output_item.done", 2, "function_call"),
        ("response.output_item.added", 3, "custom_tool_call"),
        ("response.custom_tool_call_input.delta", 3, PATCH),  # the raw input, once the call's JSON is complete
        ("response.custom_tool_call_input.done", 3, None),
        ("response.output_item.done", 3, "custom_tool_call"),
        ("response.completed", None, None),
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        adapter.validate_python(e)  # each event as the SDK's types define it

    final = events[-1]["response"]
    added = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.added"}
    done = {e["output_index"]: e["item"] for e in events if e["type"] == "response.output_item.done"}
    for i, item in enumerate(final["output"]):  # ids and call ids agree wherever an item appears
        assert added[i]["id"] == done[i]["id"] == item["id"] and added[i].get("call_id") == item.get("call_id")
        assert done[i] == item
    reasoning, message, call, custom = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "Think twice."}] and reasoning["summary"] == []
    assert message["content"][0]["text"] == "\n\nHere we go." and message["status"] == "completed"
    assert (call["call_id"], call["name"], call["arguments"], call["status"]) == (
        "call_w",
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert (custom["call_id"], custom["name"], custom["input"]) == ("call_p", "apply_patch", PATCH)
    assert [i["id"][:3] for i in final["output"]] == ["rs_", "msg", "fc_", "ctc"]
    assert final["status"] == "completed" and final["usage"] == {
        "input_tokens": 20,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 30,
        "output_tokens_details": {"reasoning_tokens": 2},  # "Think twice." by the test's word counter
        "total_tokens": 50,
    }
    # the text events name their item and part
    text_deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert {(e["item_id"], e["content_index"]) for e in text_deltas} == {(message["id"], 0)}


def test_the_sdk_accumulator_ends_with_the_whole_answers_response():
    events = stream(STREAM)
    state = ResponseStreamState(input_tools=TOOLS, text_format=openai.omit)
    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:
        state.handle_event(adapter.validate_python(e))
    streamed = state._completed_response
    whole = whole_response(
        builder(), {"choices": [{"message": MESSAGE, "finish_reason": "tool_calls"}], "usage": USAGE}, 4
    )
    Response.model_validate(whole)  # the SDK's type, validated
    assert streamed.output_text == "\n\nHere we go." == Response.model_validate(whole).output_text

    def without_ids(output: list[dict]) -> list[dict]:
        """Items less their ids (made per answer) and what the SDK's parser adds (parsed, parsed_arguments)."""
        added = ("id", "parsed", "parsed_arguments")
        out = []
        for item in output:
            item = {k: v for k, v in item.items() if k not in added}
            if item["type"] == "message":
                item["content"] = [{k: v for k, v in part.items() if k not in added} for part in item["content"]]
            out.append(item)
        return out

    assert without_ids([o.to_dict() for o in streamed.output]) == without_ids(whole["output"])
    assert whole["usage"] == events[-1]["response"]["usage"]


def test_the_response_echoes_the_request_fields_the_sdk_requires():
    b = builder(instructions="Be brief.", temperature=0.0, max_output_tokens=9, metadata={"k": "v"}, tool_choice="auto")
    body = b.body()
    Response.model_validate(body)
    assert body["object"] == "response" and body["status"] == "in_progress" and body["output"] == []
    assert (body["instructions"], body["temperature"], body["top_p"], body["max_output_tokens"]) == (
        "Be brief.",
        0.0,
        1.0,
        9,
    )
    assert body["tools"] == TOOLS and body["tool_choice"] == "auto" and body["parallel_tool_calls"] is True
    assert body["text"] == {"format": {"type": "text"}} and body["store"] is False and body["metadata"] == {"k": "v"}


def test_max_output_tokens_makes_the_response_and_its_last_item_incomplete():
    chunks = [
        _chunk({"content": "One two"}),
        _chunk({"content": " three"}, finish="length"),
        {"choices": [], "usage": USAGE},
    ]
    events = stream(chunks, builder(max_output_tokens=3))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    whole = whole_response(
        builder(max_output_tokens=3),
        {"choices": [{"message": {"content": "One two three"}, "finish_reason": "length"}], "usage": USAGE},
        0,
    )
    assert whole["status"] == "incomplete" and whole["output"][0]["status"] == "incomplete"
    assert whole["output"][0]["content"][0]["text"] == "One two three"


def test_an_empty_answer_has_no_items():
    events = stream([_chunk({"content": ""}, finish="stop"), {"choices": [], "usage": USAGE}])
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert events[-1]["response"]["output"] == []


def test_an_engine_failure_mid_stream_ends_with_error_and_response_failed():
    events = stream(STREAM, fail_after=6)  # inside the function call's arguments
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert "Traceback" not in json.dumps(events) and "engine failed" not in json.dumps(events)
    assert [i["type"] for i in failed["output"]] == ["reasoning", "message"]  # the items done before it failed
    TypeAdapter(ResponseStreamEvent).validate_python(events[-2])
    Response.model_validate(failed)


def test_a_client_that_goes_away_closes_the_chat_stream():
    closed: list = []

    async def run() -> None:
        lines = response_events(builder(), _chunks(STREAM, closed=closed), SimpleNamespace(cached=0))
        for _ in range(5):
            await anext(lines)
        await lines.aclose()  # what the server does when the client disconnects

    asyncio.run(run())
    assert closed == [True]  # the chat stream's finally ran: there the engine work is aborted


@pytest.mark.parametrize(
    "arguments, expected",
    [
        ('{"input": "raw text"}', "raw text"),
        ('{"input": "line 1\nline 2"}', "line 1\nline 2"),  # a raw newline in the JSON string
        ('{"patch": "only string"}', "only string"),
        ('{"a": 1}', '{"a": 1}'),
        ("not json", "not json"),
    ],
)
def test_custom_tool_input_is_the_string_the_model_wrote(arguments, expected):
    assert custom_tool_input(arguments) == expected
