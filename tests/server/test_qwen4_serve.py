"""`ember serve`'s app on a tiny random qwen4_exp (Qwen3.8-Flash-Next) with the release's kind of chat template
(tests/models/qwen4_chat_template.jinja: thinking always on, reasoning_effort low / medium / xhigh, Qwen3-Coder
XML tool calls), read through the official `openai` SDK: the template alone chooses the XML tool parser and the
reasoning parser; answers come whole and streamed alike with the reasoning split off; reasoning_effort given
the three ways changes the rendered prompt; a forced call comes back as a typed `tool_calls` entry.

The model is random, so its output is steered honestly: it never writes `</think>` by itself, so a logit_bias
on that token (one token in Qwen's vocabulary, and in this tokenizer) makes it end its reasoning, and a named
tool_choice holds the answer after it to an XML call (xgrammar), as test_tool_calls_qwen_xml.py does."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.models.tiny_qwen4 import build_qwen4, save_qwen4_chat
from tests.server.live import MODEL_NAME, start_server

pytestmark = pytest.mark.engine

ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for Paris",
        # no free string: a random model fills one with whitespace the grammar allows
        "parameters": {
            "type": "object",
            "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["days"],
        },
    },
}
END = "</think>"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    path = save_qwen4_chat(build_qwen4(), str(tmp_path_factory.mktemp("qwen4-chat")))
    server = start_server(path, executor="eager", max_model_len=1024, kv_cache_memory=0.02)
    yield server
    server.stop()


def _end_bias(live, bias: float) -> dict[str, float]:
    [end] = live.engine.parts.loaded.tokenizer.encode(END, add_special_tokens=False)
    return {str(end): bias}


def _text(live, ids: list[int]) -> str:
    return live.engine.parts.loaded.tokenizer.decode(ids, skip_special_tokens=True)


def _streamed(client, **kw) -> tuple[str, str, str]:
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


def test_the_template_chooses_xml_tool_calls_and_the_reasoning_parser(live):
    serving = live.app.state.serving
    assert serving.tool_parser.name == "qwen3_coder"
    assert serving.reasoning.name == "qwen3" and "always opens <think>" in serving.reasoning.reason
    assert live.engine.structured.reasoning_parser == "qwen3"  # forced answers start after </think>


def test_an_answer_starts_in_reasoning_whole_and_streamed_alike(live):
    client = live.client()
    kw = dict(model=MODEL_NAME, messages=ASK, max_tokens=12, temperature=0)
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    message, written = r.choices[0].message, _text(live, r.choices[0].token_ids)
    assert END not in written  # the model never closes its reasoning here: all of it is reasoning
    assert message.reasoning_content == written and message.content is None
    assert _streamed(client, **kw) == (written, "", r.choices[0].finish_reason)


def test_reasoning_and_content_are_split_at_think_end(live):
    client = live.client()
    kw = dict(model=MODEL_NAME, messages=ASK, max_tokens=40, temperature=1.0, seed=3, logit_bias=_end_bias(live, 4))
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    message, written = r.choices[0].message, _text(live, r.choices[0].token_ids)
    assert message.reasoning_content and message.content  # both sides of the first </think>
    assert written == message.reasoning_content + END + message.content
    assert _streamed(client, **kw)[:2] == (message.reasoning_content, message.content)


def _system_turn(live, **kw) -> tuple[str, int]:
    """(the effort line the template rendered, the prompt's length) of a chat request."""
    extra = {"return_token_ids": True, **kw.pop("extra_body", {})}
    r = live.client().chat.completions.create(
        model=MODEL_NAME, messages=ASK, max_tokens=1, temperature=0, extra_body=extra, **kw
    )
    prompt = _text(live, r.prompt_token_ids)
    return prompt.split("\n")[1].split(".")[0], r.usage.prompt_tokens


def test_reasoning_effort_reaches_the_template_three_ways(live):
    default, xhigh_len = _system_turn(live)
    assert default == "Reasoning effort: xhigh"  # the template's default
    low, low_len = _system_turn(live, reasoning_effort="low")  # OpenAI's field, as the SDK sends it
    assert low == "Reasoning effort: low" and low_len != xhigh_len
    kwargs = {"chat_template_kwargs": {"reasoning_effort": "medium"}}
    assert _system_turn(live, extra_body=kwargs)[0] == "Reasoning effort: medium"
    assert _system_turn(live, reasoning_effort="low", extra_body=kwargs)[0] == "Reasoning effort: medium"  # wins
    # OpenAI's values the template does not take: the nearest it does, a tie going up
    assert _system_turn(live, reasoning_effort="high")[0] == "Reasoning effort: xhigh"
    assert _system_turn(live, reasoning_effort="minimal")[0] == "Reasoning effort: low"

    # the Responses API's reasoning.effort: the same prompt as chat's, counted and answered
    client = live.client()
    answered = client.responses.create(
        model=MODEL_NAME, input=ASK[0]["content"], reasoning={"effort": "low"}, max_output_tokens=1
    )
    assert answered.usage.input_tokens == low_len
    counted = httpx.post(
        live.url + "/v1/responses/input_tokens",
        json={"model": MODEL_NAME, "input": ASK[0]["content"], "reasoning": {"effort": "low"}},
        timeout=30,
    ).json()
    assert counted["input_tokens"] == low_len
    assert (
        client.responses.create(model=MODEL_NAME, input=ASK[0]["content"], max_output_tokens=1).usage.input_tokens
        == xhigh_len
    )


def test_the_offline_chat_api_takes_the_effort_too(live):
    from ember import LLM, SamplingParams

    llm = LLM(live.app.state.serving.config.model_root, dtype="float32", executor="eager", kv_cache_memory=0.01)
    try:
        params = SamplingParams(max_tokens=1, temperature=0)
        [out] = llm.chat(ASK, params, use_tqdm=False, reasoning_effort="max")
        assert "Reasoning effort: xhigh." in _text(live, out.prompt_token_ids)
        [out] = llm.chat(ASK, params, use_tqdm=False, chat_template_kwargs={"reasoning_effort": "low"})
        assert "Reasoning effort: low." in _text(live, out.prompt_token_ids)
    finally:
        llm.close()


@pytest.mark.parametrize(
    "kw, says",
    [
        ({"reasoning_effort": "none"}, "always thinks"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort 'extreme' is not one of none, minimal, low"),
        ({"extra_body": {"chat_template_kwargs": {"reasoning_effort": "high"}}}, "must be one of low, medium, xhigh"),
    ],
)
def test_an_effort_the_template_cannot_take_is_a_400(live, kw, says):
    with pytest.raises(openai.BadRequestError, match=says):
        live.client().chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1, **kw)


def test_responses_name_the_effort_field_they_were_sent(live):
    r = httpx.post(
        live.url + "/v1/responses",
        json={"model": MODEL_NAME, "input": "hi", "reasoning": {"effort": "none"}, "max_output_tokens": 1},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort"


def test_a_forced_xml_call_comes_back_as_tool_calls_whole_and_streamed(live):
    client = live.client()
    kw = dict(
        model=MODEL_NAME,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=160,
        temperature=0,
        logit_bias=_end_bias(live, 2),  # the reasoning ends; the call is held to its grammar after </think>
    )
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert _text(live, choice.token_ids).startswith(END + "<tool_call>\n<function=get_weather>\n")  # XML, as written
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    assert isinstance(args["days"], int)

    with client.chat.completions.stream(**kw) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)
