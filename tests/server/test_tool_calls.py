"""Qwen/Hermes tool calls: the parser on its own (fed whole, char by char, in random pieces) and
through the real API path, on a server whose sampler plays a scripted model output."""

from __future__ import annotations

import json
import random

import pytest

from ember.server.tool_parsers import HermesToolParser, parse_tool_calls
from tests.server.live import MODEL_NAME, start_server

CALL1 = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "days": [1, 2]}}'
CALL2 = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
TWO_CALLS = f"I'll check both.\n<tool_call>\n{CALL1}\n</tool_call>\n<tool_call>\n{CALL2}\n</tool_call>"
ARGS1 = json.loads(CALL1)["arguments"]
ARGS2 = json.loads(CALL2)["arguments"]


def replay(text: str, pieces: list[int]) -> tuple[str, list[dict]]:
    """Feed text in pieces of the given sizes; assemble content and calls as a client would."""
    p = HermesToolParser()
    content, calls = "", {}
    i = 0
    deltas = []
    for n in pieces + [len(text)]:
        deltas.append(p.feed(text[i : i + n]))
        i += n
        if i >= len(text):
            break
    deltas.append(p.finish())
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            slot = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert slot["id"] is None, "the id comes once"
                slot["id"], slot["name"] = tc["id"], tc["function"]["name"]
            else:
                assert slot["id"] is not None, "arguments before the call's head"
            slot["arguments"] += tc["function"].get("arguments", "")
    return content, [calls[k] for k in sorted(calls)]


def test_whole_text():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "I'll check both.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS1), ("get_time", ARGS2)]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    # only calls: content is None
    assert parse_tool_calls(f"<tool_call>{CALL2}</tool_call>")[0] is None


@pytest.mark.parametrize("seed", range(20))
def test_streamed_in_random_pieces_equals_whole(seed):
    rng = random.Random(seed)
    pieces = [rng.randint(1, 6) for _ in range(len(TWO_CALLS))]
    content, calls = replay(TWO_CALLS, pieces)
    whole_content, whole = parse_tool_calls(TWO_CALLS)
    assert content == whole_content
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole]
    assert "<" not in content


def test_char_by_char_streams_arguments_in_many_deltas():
    p = HermesToolParser()
    arg_deltas = 0
    for ch in TWO_CALLS:
        d = p.feed(ch)
        assert "<tool" not in d.content and "tool_call" not in d.content
        arg_deltas += sum(1 for tc in d.tool_calls if tc["function"].get("arguments"))
    p.finish()
    assert arg_deltas > 20  # arguments arrive as they are written, not at the end


def test_not_a_call_stays_content():
    text = "Use <tool_call> tags like <tool_call>not json</tool_call> and a < b."
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == text
    assert replay(text, [1] * len(text)) == (text, [])
    # an unclosed tag at the end is content too, unless its JSON is whole
    assert replay("see <tool_call> the", [3] * 10) == ("see <tool_call> the", [])
    content, calls = replay(f"<tool_call>\n{CALL2}", [4] * 40)
    assert content == "" and calls[0]["name"] == "get_time" and json.loads(calls[0]["arguments"]) == ARGS2


def test_arguments_before_name_and_string_escapes():
    odd = '{"arguments": {"q": "a \\"quoted\\" }"}, "name": "search"}'
    content, calls = replay(f"<tool_call>{odd}</tool_call>", [2] * 40)
    assert calls[0]["name"] == "search" and json.loads(calls[0]["arguments"]) == {"q": 'a "quoted" }'}
    esc = '{"name": "say", "arguments": {"text": "}} </tool_ \\n"}}'
    content, calls = replay(f"<tool_call>{esc}</tool_call>", [1] * 80)
    assert json.loads(calls[0]["arguments"]) == {"text": "}} </tool_ \n"}


# -- through the API -------------------------------------------------------------------------------


class ScriptedSampler:
    """Plays a fixed token sequence for requests whose prompt contains a key; others sample normally."""

    def __init__(self, inner, tokenizer, scripts: dict[str, str], eos: int):
        self.inner = inner
        self.tok = tokenizer
        self.scripts = {k: tokenizer.encode(v, add_special_tokens=False) + [eos] for k, v in scripts.items()}
        self._prompts: dict[tuple, list[int] | None] = {}

    def _script(self, prompt_ids) -> list[int] | None:
        key = tuple(prompt_ids)
        if key not in self._prompts:
            text = self.tok.decode(list(prompt_ids), skip_special_tokens=False)
            self._prompts[key] = next((s for k, s in self.scripts.items() if k in text), None)
        return self._prompts[key]

    def __call__(self, logits, rows):
        from ember.layers.sampler import SampledToken

        out = self.inner(logits, rows)
        for i, row in enumerate(rows):
            script = self._script(row.prompt_token_ids)
            if script is not None:
                n = len(row.output_token_ids)
                out[i] = SampledToken(script[min(n, len(script) - 1)])
        return out


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
# ChatML that lists the tools' names (Qwen's lists their JSON; the tiny model's context is short).
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %} {{ t.function.name }}{% endfor %}</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}<tool_call>\n{{ c.function | tojson }}\n</tool_call>{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def scripted(tiny_qwen3):
    live = start_server(tiny_qwen3, chat_template=TOOLS_TEMPLATE)
    eng = live.engine
    eos = eng.parts.loaded.tokenizer.token_to_id("<|im_end|>")
    eng.parts.runner.sampler = ScriptedSampler(
        eng.parts.runner.sampler,
        eng.parts.loaded.tokenizer,
        {"[two calls]": TWO_CALLS, "[plain]": "Just text, no calls."},
        eos,
    )
    yield live
    live.stop()


def ask(key: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather and time in Paris? {key}"}]


def test_tools_reach_the_template(scripted):
    c = scripted.client()
    with_tools = c.chat.completions.create(model=MODEL_NAME, messages=ask("[plain]"), tools=TOOLS, max_tokens=3)
    without = c.chat.completions.create(model=MODEL_NAME, messages=ask("[plain]"), max_tokens=3)
    none = c.chat.completions.create(
        model=MODEL_NAME, messages=ask("[plain]"), tools=TOOLS, tool_choice="none", max_tokens=3
    )
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens == none.usage.prompt_tokens


def test_tool_calls_whole(scripted):
    r = scripted.client().chat.completions.create(model=MODEL_NAME, messages=ask("[two calls]"), tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "I'll check both.\n"
    calls = ch.message.tool_calls
    assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("function", "get_weather", ARGS1),
        ("function", "get_time", ARGS2),
    ]
    tok = scripted.engine.parts.loaded.tokenizer
    assert r.usage.completion_tokens == len(tok.encode(TWO_CALLS, add_special_tokens=False)) + 1
    # without tools in the request the same text is plain content
    r = scripted.client().chat.completions.create(model=MODEL_NAME, messages=ask("[two calls]"))
    assert r.choices[0].message.content == TWO_CALLS and r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls == []  # vLLM's empty list


def test_tool_calls_streamed_as_deltas(scripted):
    stream = scripted.client().chat.completions.create(
        model=MODEL_NAME, messages=ask("[two calls]"), tools=TOOLS, stream=True
    )
    content, calls, finish, arg_chunks = "", {}, None, 0
    for chunk in stream:
        for c in chunk.choices:
            d = c.delta
            content += d.content or ""
            assert "tool_call" not in (d.content or "")
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert slot["id"] is None
                    slot["id"], slot["name"] = tc.id, tc.function.name
                    assert tc.type == "function"
                if tc.function and tc.function.arguments:
                    slot["arguments"] += tc.function.arguments
                    arg_chunks += 1
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    assert content == "I'll check both.\n"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", ARGS1),
        ("get_time", ARGS2),
    ]
    assert all(c["id"].startswith("call_") for c in calls.values())
    assert arg_chunks > 4  # split over many chunks, as the model wrote them


def test_tool_round_trip_messages_render(scripted):
    """The assistant's tool_calls (arguments as JSON text) and a tool result go back into the template."""
    messages = ask("[plain]") + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    r = scripted.client().chat.completions.create(model=MODEL_NAME, messages=messages, tools=TOOLS)
    assert r.choices[0].message.content == "Just text, no calls." and r.choices[0].finish_reason == "stop"
