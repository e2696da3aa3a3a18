"""Structured outputs and reasoning through the official `openai` client against a live server on the
default model (SmolLM2-135M, packed, MTP speculation on, as `ember serve` runs it).

Every constrained answer is parsed, validated with jsonschema and must end with `stop` (tool calls:
`tool_calls`), streamed or not."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from ember.default_model import default_model_path
from tests.server.live import MODEL_NAME, start_server
from tests.structured.schemas import SCHEMAS, TOOLS

MAX_TOKENS = 400
# A template that opens the assistant turn with <think> (as DeepSeek-R1's and Qwen3.5's do), or closes it
# at once under enable_thinking false (as Qwen3's does).
THINKING_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}{% if enable_thinking is defined and enable_thinking is false %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}"
)
FEW_SHOT = (
    'Q: 2+2?\n<think>\nI add the numbers.\n</think>\n{"answer": 4}\n\n'
    'Q: 3+3?\n<think>\nI add the numbers.\n</think>\n{"answer": 6}\n\nQ: 5+2?'
)
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


@pytest.fixture(scope="module")
def live():
    server = start_server(default_model_path(), dtype="auto", num_threads=2, kv_cache_memory=0.3, max_model_len=2048)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking():
    server = start_server(
        default_model_path(),
        dtype="auto",
        num_threads=2,
        kv_cache_memory=0.2,
        max_model_len=1024,
        reasoning_parser="deepseek_r1",
        chat_template=THINKING_TEMPLATE,
    )
    yield server
    server.stop()


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_validates_through_response_format(live, temperature):
    client = live.async_client()

    async def ask(name: str):
        prompt, schema = SCHEMAS[name]
        return await client.chat.completions.create(
            model=MODEL_NAME,
            messages=user(prompt),
            temperature=temperature,
            seed=21,
            max_tokens=MAX_TOKENS,
            response_format=json_format(name, schema),
        )

    async def ask_all():
        return await asyncio.gather(*(ask(n) for n in SCHEMAS))

    answers = asyncio.run(ask_all())
    for name, r in zip(SCHEMAS, answers):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (name, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name][1])
    live.wait_idle()


def test_streamed_schema_answer_validates(live):
    prompt, schema = SCHEMAS["array_of_objects"]
    stream = live.client().chat.completions.create(
        model=MODEL_NAME,
        messages=user(prompt),
        temperature=1.0,
        seed=4,
        max_tokens=MAX_TOKENS,
        stream=True,
        response_format=json_format("products", schema),
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_completions_take_structured_outputs_and_the_guided_fields(live):
    client = live.client()
    prompt, schema = SCHEMAS["person"]
    for extra in (
        {"structured_outputs": {"json": schema}},
        {"guided_json": schema},
        {"guided_json": json.dumps(schema)},
    ):
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt + "\n", max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
        )
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].text), schema)
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt="Pick a direction:",
        max_tokens=10,
        stream=True,
        extra_body={"guided_choice": ["north", "south"]},
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) in ("north", "south")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_choice_and_regex(live):
    client = live.client()
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user("Is the sky green?"),
        temperature=1.0,
        max_tokens=20,
        extra_body={"guided_choice": ["yes", "no", "maybe"]},
    )
    assert r.choices[0].message.content in ("yes", "no", "maybe") and r.choices[0].finish_reason == "stop"
    pattern = r"[A-Z]{2}-[0-9]{3}"
    for extra in ({"guided_regex": pattern}, {"structured_outputs": {"regex": pattern}}):
        r = client.chat.completions.create(
            model=MODEL_NAME, messages=user("Give a plate number."), max_tokens=20, temperature=1.0, extra_body=extra
        )
        assert re.fullmatch(pattern, r.choices[0].message.content) and r.choices[0].finish_reason == "stop"
    # Any object (no schema bounds it): an open prompt can make this model nest objects until max_tokens.
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user('Reply with a small JSON object such as {"ok": true}.'),
        temperature=0,
        max_tokens=MAX_TOKENS,
        response_format={"type": "json_object"},
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict) and r.choices[0].finish_reason == "stop"


def _check_calls(calls, names: set[str]) -> None:
    assert calls
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


@pytest.mark.parametrize("parallel", [None, False])
def test_tool_choice_required(live, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = live.client().chat.completions.create(
        model=MODEL_NAME,
        messages=user("Find me a flight from Paris to Rome."),
        tools=TOOLS,
        tool_choice="required",
        temperature=0.7,
        seed=2,
        max_tokens=MAX_TOKENS,
        **extra,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls, {"get_weather", "search_flights"})
    if parallel is False:
        assert len(choice.message.tool_calls) == 1


def test_tool_choice_named_streamed_and_not(live):
    client = live.client()
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user("Find me a flight to Rome."),
        tools=TOOLS,
        tool_choice=named,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    assert r.choices[0].finish_reason == "tool_calls"
    _check_calls(r.choices[0].message.tool_calls, {"get_weather"})
    whole = r.choices[0].message.tool_calls[0].function.arguments

    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user("Find me a flight to Rome."),
        tools=TOOLS,
        tool_choice=named,
        temperature=0,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    name, args, finish = None, "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        for d in chunk.choices[0].delta.tool_calls or []:
            name = d.function.name or name
            args += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and finish == "tool_calls" and args == whole


def test_bad_constraints_get_a_400_and_the_server_keeps_serving(live):
    client = live.client()
    bad = [
        ({"response_format": json_format("x", {"type": "nope"})}, "Unsupported type"),
        ({"extra_body": {"guided_regex": "a(b"}}, "parenthesis"),
        ({"extra_body": {"structured_outputs": {"grammar": "root ::= nothing_here"}}}, "not defined"),
        ({"extra_body": {"guided_json": {"type": "object"}, "guided_regex": "a"}}, "give one of them"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not in tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"extra_body": {"structured_outputs": {"json": {}, "whitespace_pattern": " "}}}, "whitespace"),
    ]
    for kw, says in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=user("hi"), max_tokens=5, **kw)
        assert says in e.value.body["message"], (kw, e.value.body)
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=user("hi"), max_tokens=5, extra_body={"guided_choice": ["fine"]}
    )
    assert r.choices[0].message.content == "fine"
    live.wait_idle()


def test_metrics_report_compile_and_mask_time(live):
    live.client().chat.completions.create(
        model=MODEL_NAME, messages=user("Yes?"), max_tokens=5, extra_body={"guided_choice": ["metric check"]}
    )
    text = httpx.get(live.url + "/metrics").text
    counts = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^ember:structured_output_(compile|mask)_seconds_count\{[^}]*\} (\S+)$", text, re.M)
    }
    assert counts.get("compile", 0) >= 1 and counts.get("mask", 0) >= 1


def test_reasoning_content_is_split_from_the_answer(thinking):
    client = thinking.client()
    r = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user(FEW_SHOT),
        temperature=0,
        max_tokens=60,
        response_format=json_format("answer", ANSWER_SCHEMA),
    )
    message = r.choices[0].message
    assert "I add" in message.reasoning_content and "</think>" not in message.reasoning_content
    assert message.reasoning == message.reasoning_content  # vLLM's newer name, the same text
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)  # the constraint started after </think>

    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=user(FEW_SHOT),
        temperature=0,
        max_tokens=60,
        stream=True,
        response_format=json_format("answer", ANSWER_SCHEMA),
    )
    reasoning, newer_name, content = "", "", ""
    for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            newer_name += getattr(delta, "reasoning", None) or ""
            content += delta.content or ""
    assert (reasoning, newer_name, content) == (message.reasoning_content, message.reasoning, message.content)


def test_enable_thinking_false_leaves_everything_in_the_answer(thinking):
    r = thinking.client().chat.completions.create(
        model=MODEL_NAME,
        messages=user("Say a word."),
        temperature=0,
        max_tokens=12,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = r.choices[0].message
    assert message.reasoning_content is None and message.reasoning is None and message.content
