"""POST /v1/responses and /v1/responses/input_tokens through the official `openai` SDK (and raw HTTP
where a client such as Codex sends what the SDK would not) against a live server on the default
model (SmolLM2-135M). With a 135M model the checks are the protocol: the stream parses in the SDK's
accumulator and equals the whole answer, a forced call round-trips, a schema holds, refusals are
400s that say why, and the engine is left idle."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from ember.default_model import default_model_path
from tests.server.live import MODEL_NAME, start_server
from tests.server.test_structured_outputs import FEW_SHOT, THINKING_TEMPLATE

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.", "parameters": WEATHER_PARAMS}
# Codex's freeform apply_patch tool, cut down: a Lark grammar the model is told about (not held to)
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Use the `apply_patch` tool to edit files.",
    "format": {
        "type": "grammar",
        "syntax": "lark",
        "definition": 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?\n'
        'hunk: "*** Add File: " filename LF add_line+\nfilename: /(.+)/\nadd_line: "+" /(.*)/ LF\n%import common.LF\n',
    },
}


@pytest.fixture(scope="module")
def live():
    server = start_server(default_model_path(), dtype="auto", num_threads=2, kv_cache_memory=0.2, max_model_len=2048)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking():
    """A server that splits reasoning off (a template that opens <think>, --reasoning-parser deepseek_r1)."""
    server = start_server(
        default_model_path(),
        dtype="auto",
        num_threads=2,
        kv_cache_memory=0.1,
        max_model_len=512,
        reasoning_parser="deepseek_r1",
        chat_template=THINKING_TEMPLATE,
    )
    yield server
    server.stop()


def sse_events(response: httpx.Response) -> list[dict]:
    """The events of a Responses stream, each `event: TYPE` / `data: JSON` checked against the other."""
    events, kind = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line.removeprefix("event: ")
        elif line.startswith("data: "):
            event = json.loads(line.removeprefix("data: "))
            assert event["type"] == kind and event["sequence_number"] == len(events)
            events.append(event)
    return events


def test_create_and_stream_agree_at_temperature_0(live):
    client = live.client()
    ask = dict(model=MODEL_NAME, instructions="Answer in one sentence.", input="What is the capital of France?")
    whole = client.responses.create(**ask, temperature=0, max_output_tokens=24)
    with client.responses.stream(**ask, temperature=0, max_output_tokens=24) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert whole.object == "response" and whole.id.startswith("resp_") and whole.model == MODEL_NAME
    assert whole.output_text and "".join(deltas) == whole.output_text == final.output_text
    assert final.status == whole.status and whole.status in ("completed", "incomplete")
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"
    message = whole.output[0]
    assert (message.type, message.role, message.content[0].type, message.content[0].annotations) == (
        "message",
        "assistant",
        "output_text",
        [],
    )
    assert whole.usage.input_tokens == final.usage.input_tokens > 10
    assert whole.usage.output_tokens == final.usage.output_tokens <= 24
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: a prefix-cache hit
    assert whole.usage.output_tokens_details.reasoning_tokens == 0  # no reasoning parser on this server
    assert whole.temperature == 0 and whole.max_output_tokens == 24 and whole.instructions == ask["instructions"]
    live.wait_idle()


def test_a_forced_function_call_round_trips(live):
    client = live.client()
    question = {"role": "user", "content": "What is the weather in Paris?"}
    first = client.responses.create(
        model=MODEL_NAME,
        input=[question],
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    )
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and len(calls) == 1, first.output
    call = calls[0]
    assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    # the second turn sends the call back (as the SDK returned it) with its output
    second = client.responses.create(
        model=MODEL_NAME,
        input=[question, *[item.model_dump(exclude_none=True) for item in first.output]]
        + [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_output_tokens=30,
    )
    assert [item.type for item in second.output] == ["message"] and second.output_text
    assert second.usage.input_tokens > first.usage.input_tokens
    live.wait_idle()


def test_a_streamed_forced_call_keeps_its_ids_from_added_to_completed(live):
    tool = {**WEATHER, "strict": True}  # strict: the SDK parses the arguments itself
    with live.client().responses.stream(
        model=MODEL_NAME,
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=60,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert [(i.id, i.call_id) for i in added] == [(i.id, i.call_id) for i in done] == [(call.id, call.call_id)]
    assert args == call.arguments and call.parsed_arguments == json.loads(args)
    assert events[-1].type == "response.completed"
    live.wait_idle()


def test_text_format_json_schema_gives_valid_json(live):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    response = live.client().responses.create(
        model=MODEL_NAME,
        input="Give the largest city of Japan and its population as JSON.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
        temperature=0,
        max_output_tokens=200,
    )
    assert response.status == "completed" and response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_stateful_requests_are_refused_with_a_400_that_says_why(live):
    client = live.client()
    for extra in ({"store": True}, {"previous_response_id": "resp_123"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=4, **extra)
        error = e.value.body
        assert e.value.status_code == 400 and error["param"] == next(iter(extra))
        assert "keeps no state" in error["message"] and "store false" in error["message"]
    bad = httpx.post(live.url + "/v1/responses", json={"model": MODEL_NAME, "input": [{"type": "nope"}]})
    assert bad.status_code == 400 and "'nope' is not supported" in bad.json()["error"]["message"]
    broken = httpx.post(live.url + "/v1/responses", content=b"{not json", headers={"content-type": "application/json"})
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"
    too_long = httpx.post(live.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 10**6})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "max_output_tokens"
    unknown = httpx.post(live.url + "/v1/responses", json={"model": "gpt-9", "input": "hi"})
    assert unknown.status_code == 404
    # the server still answers
    assert live.client().responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2).status


def test_a_codex_like_request_is_answered(live):
    """What Codex sends (as codex-cli 0.171 sent it to ember, plus what other versions add): instructions,
    a developer message, a reasoning item from an earlier turn, a custom apply_patch tool with a Lark
    grammar, a function tool, hosted tools to leave out, and the fields that change nothing; streamed,
    as Codex reads it."""
    history = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a README."}]},
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [{"type": "summary_text", "text": "I should create the file."}],
            "content": [{"type": "reasoning_text", "text": "Create README.md."}],
            "encrypted_content": None,
        },
    ]
    shell = {
        "type": "function",
        "name": "shell",
        "description": "Runs a shell command.",
        "strict": False,
        "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}}},
    }
    body = {
        "model": MODEL_NAME,
        "instructions": "You are Codex, a coding agent.",
        "input": history,
        "tools": [
            shell,
            APPLY_PATCH,
            {"type": "namespace", "name": "multi_agent_v1", "tools": []},
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": {"type": "custom", "name": "apply_patch"},
        "parallel_tool_calls": False,
        "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "019a-session",
        "client_metadata": {"x-codex-installation-id": "21310a24"},
        "text": {"verbosity": "medium"},
        "max_output_tokens": 80,
    }
    with httpx.stream("POST", live.url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["status"] == "completed"
    (call,) = [item for item in final["output"] if item["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and call["id"].startswith("ctc_") and isinstance(call["input"], str)
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    (input_done,) = [e for e in events if e["type"] == "response.custom_tool_call_input.done"]
    assert input_done["input"] == call["input"] and input_done["item_id"] == call["id"]
    assert final["tools"] == body["tools"] and final["store"] is False
    live.wait_idle()


def test_input_tokens_counts_the_prompt_as_tokenize_does(live):
    client = live.client()
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny."},
    ]
    count = client.responses.input_tokens.count(
        model=MODEL_NAME, instructions="Be brief.", input=items, tools=[WEATHER]
    )
    # the same conversation as chat messages, written by hand
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny."},
    ]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    tokenized = httpx.post(
        live.url + "/tokenize", json={"model": MODEL_NAME, "messages": messages, "tools": chat_tools}
    )
    assert count.object == "response.input_tokens" and count.input_tokens == tokenized.json()["count"] > 20
    # and it is the prompt /v1/responses answers
    answered = client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", input=items, tools=[WEATHER], max_output_tokens=1
    )
    assert answered.usage.input_tokens == count.input_tokens


def test_a_client_that_leaves_mid_stream_frees_the_engine(live):
    body = {"model": MODEL_NAME, "input": "Count from one to a thousand.", "stream": True, "max_output_tokens": 1500}
    with httpx.stream("POST", live.url + "/v1/responses", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break  # leave after the first piece of text
    live.wait_idle()  # the engine request was aborted, its KV blocks freed


def test_openapi_documents_the_stream(live):
    spec = httpx.get(live.url + "/openapi.json").json()
    ok = spec["paths"]["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert {"application/json", "text/event-stream"} <= set(ok)
    assert "400" in spec["paths"]["/v1/responses/input_tokens"]["post"]["responses"]


ODD_VALUES = [None, 0, -1, 1.5, "", "x", [], {}, [{}], [None], {"type": "x"}, [{"type": "message"}], True]


def _mutations(body: dict, rng) -> dict:
    """body with one field, or one field of one input item or tool, set to an odd value."""
    body = json.loads(json.dumps(body))
    target = rng.choice([body, *body["input"], *body["tools"]])
    key = rng.choice([k for k in target if k != "max_output_tokens"] + ["type", "role", "content"])
    target[key] = rng.choice(ODD_VALUES)
    return body


def test_odd_requests_are_400s_and_never_take_the_server_down(live):
    import random

    rng = random.Random(7)
    base = {
        "model": MODEL_NAME,
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Sunny."},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "hm"}]},
        ],
        "tools": [WEATHER, APPLY_PATCH, {"type": "web_search"}],
        "tool_choice": "auto",
        "text": {"format": {"type": "text"}},
        "max_output_tokens": 2,
    }
    statuses = []
    for _ in range(40):
        body = _mutations(base, rng)
        for stream in (False, True):
            r = httpx.post(live.url + "/v1/responses", json={**body, "stream": stream}, timeout=60)
            statuses.append(r.status_code)
            assert r.status_code in (200, 400, 404), (body, r.status_code, r.text[:300])
            if r.status_code != 200:
                error = r.json()["error"]
                assert error["message"] and error["type"] in ("invalid_request_error", "not_found_error"), error
            elif stream:
                assert r.text.rstrip().split("\n")[-2] in ("event: response.completed", "event: response.incomplete")
        counted = httpx.post(live.url + "/v1/responses/input_tokens", json=body, timeout=60)
        assert counted.status_code in (200, 400, 404), (body, counted.text[:300])
    assert statuses.count(200) > 10 and statuses.count(400) > 10  # both kinds were tried
    live.wait_idle()


def test_reasoning_comes_back_as_reasoning_items_whole_and_streamed(thinking):
    client = thinking.client()
    ask = dict(model=MODEL_NAME, input=FEW_SHOT, temperature=0, max_output_tokens=40)
    whole = client.responses.create(**ask)
    events = list(client.responses.create(**ask, stream=True))
    reasoning, message = whole.output
    assert (reasoning.type, message.type) == ("reasoning", "message")
    assert reasoning.summary == [] and reasoning.content[0].type == "reasoning_text"
    thought = reasoning.content[0].text
    assert thought.strip() == "I add the numbers."  # as the few-shot examples reason
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [thought]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert "<think>" not in whole.output_text.split("Q:")[0]  # the reasoning is not in the answer's text
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    assert events[-1].response.usage == whole.usage.model_copy(
        update={"input_tokens_details": events[-1].response.usage.input_tokens_details}
    )  # the same usage, but for the prefix-cache hit of the second request
