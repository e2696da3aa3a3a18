"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic SDK, against one live
server on the default model (SmolLM2-135M) with an API key: create and stream agree, count_tokens is
/tokenize's count, a forced tool_use round trip, the prefix-cache hit in usage (Claude Code's billing line
changing from turn to turn included), auth by x-api-key or Bearer, Anthropic's error shape, and a client that
hangs up mid-stream frees its request."""

from __future__ import annotations

import json
import logging

import anthropic
import httpx
import pytest

from ember.default_model import default_model_path
from tests.server.live import MODEL_NAME, start_server
from tests.server.test_streaming import metric_samples, slowed, value

pytestmark = pytest.mark.engine  # every test here runs against a live server

KEY = "sk-ember-anthropic"
CLAUDE = "claude-sonnet-4-5"
GREEDY = {"temperature": 0}  # the API takes it; this SDK's create() no longer names it
QUESTION = [{"role": "user", "content": "Name three primary colors."}]
SYSTEM = "You are a helpful assistant. " + "Answer briefly and precisely, in plain English. " * 6
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def live():
    server = start_server(
        default_model_path(), api_key=KEY, dtype="auto", num_threads=2, kv_cache_memory=0.2, max_model_len=1024
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def claude(live):
    return anthropic.Anthropic(base_url=live.url, api_key=KEY, max_retries=0, timeout=120)


def _count(live, messages: list[dict], system: str | None = None) -> int:
    """/tokenize's count of the conversation, in chat completions form."""
    chat = ([{"role": "system", "content": system}] if system else []) + messages
    return httpx.post(live.url + "/tokenize", json={"messages": chat}, timeout=30).json()["count"]


def _events(response: httpx.Response) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a raw response."""
    out = []
    for block in response.text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name[len("event: ") :], json.loads(data[len("data: ") :])))
    return out


def test_create_and_stream_agree_at_temperature_zero(live, claude):
    kw = dict(model=CLAUDE, max_tokens=24, system=SYSTEM, messages=QUESTION, extra_body=GREEDY)
    claude.messages.create(**{**kw, "max_tokens": 1})  # both answers below then find the same prefix cached
    made = claude.messages.create(**kw)
    assert made.id.startswith("msg_") and made.type == "message" and made.role == "assistant" and made.model == CLAUDE
    assert [b.type for b in made.content] == ["text"] and made.content[0].text.strip()
    assert made.stop_reason in ("end_turn", "max_tokens") and made.stop_sequence is None
    with claude.messages.stream(**kw) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == final.content[0].text == made.content[0].text
    assert final.stop_reason == made.stop_reason and final.usage.output_tokens == made.usage.output_tokens
    prompt = _count(live, QUESTION, SYSTEM)
    for usage in (made.usage, final.usage):  # input_tokens leaves out what the prefix cache read
        assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
        assert usage.input_tokens + usage.cache_read_input_tokens == prompt


def test_the_raw_stream_is_anthropics_event_sequence(live):
    body = {"model": CLAUDE, "max_tokens": 8, "temperature": 0, "messages": QUESTION, "stream": True}
    r = httpx.post(live.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert all(data["type"] == name for name, data in events)
    assert events[-2][1]["delta"]["stop_reason"] == "max_tokens" and events[-2][1]["usage"]["output_tokens"] == 8


def test_count_tokens_is_the_prompt_tokenize_counts(live, claude):
    counted = claude.messages.count_tokens(model=CLAUDE, system=SYSTEM, messages=QUESTION, tools=[WEATHER])
    assert counted.input_tokens == _count(live, QUESTION, SYSTEM)
    blocks = claude.messages.count_tokens(model=CLAUDE, system=[{"type": "text", "text": SYSTEM}], messages=QUESTION)
    assert blocks.input_tokens == counted.input_tokens
    made = claude.messages.create(model=CLAUDE, system=SYSTEM, messages=QUESTION, max_tokens=1)
    assert made.usage.input_tokens + made.usage.cache_read_input_tokens == counted.input_tokens


def test_a_forced_tool_use_and_its_result_round_trip(claude):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=CLAUDE, max_tokens=128, tools=[WEATHER], extra_body=GREEDY)
    forced = {"type": "tool", "name": "get_weather"}
    made = claude.messages.create(messages=ask, tool_choice=forced, **kw)
    assert made.stop_reason == "tool_use"
    call = made.content[-1]
    assert call.type == "tool_use" and call.name == "get_weather" and isinstance(call.input.get("city"), str)
    with claude.messages.stream(messages=ask, tool_choice=forced, **kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("tool_use", "get_weather", call.input)
    ]  # input_json_delta pieces add up to the same arguments
    turn = [
        *ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C and sunny"}]},
    ]
    answer = claude.messages.create(messages=turn, tool_choice={"type": "none"}, **kw)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content and answer.content[0].type == "text"


def test_output_config_json_schema_holds_the_answer(claude):
    schema = {
        "type": "object",
        "properties": {"color": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    }
    made = claude.messages.create(
        model=CLAUDE,
        max_tokens=64,
        messages=QUESTION,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert made.stop_reason == "end_turn" and json.loads(made.content[0].text)["color"] in ("red", "green", "blue")


def test_claude_codes_changing_billing_line_does_not_defeat_the_prefix_cache(live, claude):
    def turn(cch: str):
        system = [
            {
                "type": "text",
                "text": f"x-anthropic-billing-header: cc_version=2.1.37.3a3; cc_entrypoint=cli; cch={cch};",
            },
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
        ]
        return claude.messages.create(model=CLAUDE, max_tokens=1, system=system, messages=QUESTION).usage

    turn("0aaa9")
    second = turn("36ee5")
    prompt = _count(live, QUESTION, SYSTEM)  # the line is not in the prompt at all
    assert second.input_tokens + second.cache_read_input_tokens == prompt
    assert second.cache_read_input_tokens >= prompt - live.engine.config.cache_config.block_size


def test_a_mid_conversation_system_message_is_served_and_counted(live, claude):
    """As Claude Code 2.1.197 sends its reminders: {"role": "system"} after the user's turn (the SDK's own
    MessageParam type has it). It is served, and counted as the user text it becomes."""
    reminder = "Answer in one word."
    messages = [*QUESTION, {"role": "system", "content": [{"type": "text", "text": reminder}]}]
    counted = claude.messages.count_tokens(model=CLAUDE, system=SYSTEM, messages=messages)
    folded = [{"role": "user", "content": QUESTION[0]["content"] + "\n\n" + reminder}]
    assert counted.input_tokens == _count(live, folded, SYSTEM)
    with claude.messages.stream(model=CLAUDE, max_tokens=8, system=SYSTEM, messages=messages) as stream:
        made = stream.get_final_message()
    assert made.content and made.usage.input_tokens + made.usage.cache_read_input_tokens == counted.input_tokens


def test_tools_the_template_cannot_show_are_said_once(live, claude, caplog):
    """The default model's template has no place for tools: the model never sees them, and the log says so
    (once per server), since a client's answers would otherwise ignore its tools with no word why."""
    serving = live.app.state.serving
    assert serving.template_shows_tools is False
    serving._told_tools_unseen = False
    caplog.set_level(logging.WARNING, logger="ember.server")
    for _ in range(2):
        claude.messages.create(model=CLAUDE, max_tokens=1, messages=QUESTION, tools=[WEATHER])
    assert caplog.text.count("the chat template has no place for tools") == 1


def test_any_model_name_is_served_and_logged_once(claude, caplog):
    caplog.set_level(logging.INFO, logger="ember.server")
    for _ in range(2):
        assert claude.messages.create(model="claude-haiku-4-5-20251001", max_tokens=1, messages=QUESTION).content
    assert caplog.text.count("'claude-haiku-4-5-20251001' is served by " + MODEL_NAME) == 1


def test_api_key_by_x_api_key_or_bearer_and_refusals_in_anthropics_shape(live):
    body = {"model": CLAUDE, "max_tokens": 1, "messages": QUESTION}
    url = live.url + "/v1/messages"
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
    chat = {"model": MODEL_NAME, "messages": QUESTION, "max_tokens": 1}  # every /v1 route takes either header
    assert (
        httpx.post(live.url + "/v1/chat/completions", json=chat, headers={"x-api-key": KEY}, timeout=60).status_code
        == 200
    )
    wrong = anthropic.Anthropic(base_url=live.url, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(**body)
    assert e.value.status_code == 401 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "authentication_error" and "x-api-key" in e.value.body["error"]["message"]
    r = httpx.post(url + "/count_tokens", json=body, timeout=30)  # no key at all
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_an_image_and_other_bad_requests_are_400s_in_anthropics_shape(live, claude):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(
            model=CLAUDE,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}],
        )
    error = e.value.body["error"]
    assert e.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert "messages[0].content[1]" in error["message"] and "'image' block" in error["message"]
    headers = {"x-api-key": KEY}
    cases = [
        ({"model": CLAUDE, "messages": QUESTION}, 400, "invalid_request_error", "max_tokens"),  # missing field
        ({"model": CLAUDE, "max_tokens": 4, "messages": QUESTION, "temperature": 1.5}, 400, "invalid_request_error", "temperature"),
        ({"model": CLAUDE, "max_tokens": 4, "messages": [{"role": "user", "content": "hello " * 1200}]}, 400, "invalid_request_error", "context length"),
    ]  # fmt: skip
    for body, status, kind, words in cases:
        r = httpx.post(live.url + "/v1/messages", json=body, headers=headers, timeout=60)
        assert (r.status_code, r.json()["error"]["type"]) == (status, kind) and words in r.json()["error"]["message"]
        assert r.json()["type"] == "error"
    r = httpx.post(live.url + "/v1/messages", content=b"{not json", headers=headers, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(live.url + "/v1/messages/batches", json={}, headers=headers, timeout=10)
    assert r.status_code == 404 and r.json() == {
        "type": "error",
        "error": {"type": "not_found_error", "message": r.json()["error"]["message"]},
    }
    r = httpx.post(live.url + "/v1/chat/completions", json={"messages": []}, headers=headers, timeout=10)
    assert r.status_code == 400 and "param" in r.json()["error"]  # the OpenAI routes keep OpenAI's shape
    assert claude.messages.create(model=CLAUDE, max_tokens=1, messages=QUESTION).content  # still serving
    documented = httpx.get(live.url + "/openapi.json", timeout=10).json()["paths"]["/v1/messages"]["post"]["responses"]
    assert "text/event-stream" in documented["200"]["content"] and "422" not in documented
    assert documented["400"]["content"]["application/json"]["schema"]["required"] == ["type", "error"]


def test_a_max_tokens_beyond_the_context_is_capped(live, claude):
    """Claude Code asks for 32000 tokens; a 1024-token context serves what fits instead of refusing."""
    made = claude.messages.create(model=CLAUDE, max_tokens=32000, messages=QUESTION, extra_body=GREEDY)
    assert made.stop_reason in ("end_turn", "max_tokens") and made.usage.output_tokens < 1024


def test_a_client_that_hangs_up_mid_stream_frees_its_request(live, monkeypatch):
    live.wait_idle()
    total = live.engine.parts.kv.num_blocks
    before = metric_samples(live)
    slowed(monkeypatch, live.engine, 0.05)  # 200 tokens now take > 10 s: the hang-up comes first
    story = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]
    body = {"model": CLAUDE, "max_tokens": 200, "temperature": 0, "messages": story, "stream": True}
    with httpx.stream("POST", live.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        deltas = 0
        lines = r.iter_lines()  # held in a name: dropping it would close the connection before the checks below
        for line in lines:
            deltas += line == "event: content_block_delta"
            if deltas == 3:
                break
        assert live.engine.has_unfinished_requests()
        assert live.engine.parts.kv.num_free_blocks < total
    live.wait_idle(timeout=10)  # the connection is closed: the request is aborted and its blocks are free
    assert live.engine.parts.kv.num_free_blocks == total
    after = metric_samples(live)
    aborted = value(after, "ember:request_success_total", finished_reason="abort")
    assert aborted == value(before, "ember:request_success_total", finished_reason="abort") + 1
    assert 3 <= value(after, "ember:generation_tokens_total") - value(before, "ember:generation_tokens_total") < 200
