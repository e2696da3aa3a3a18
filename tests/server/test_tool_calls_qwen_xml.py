"""Qwen3.5's XML tool calls end to end: the default model served with a Qwen3.5-style chat template given
as `--chat-template FILE`, which makes the server choose the XML parser; forced calls are written in
that format by xgrammar's qwen_3_5 tag and come back as typed `tool_calls`, read through the official
`openai` SDK whole and with its stream accumulator, the two agreeing; the same call comes back as a
`tool_use` block through /v1/messages (the `anthropic` SDK) and a `function_call` item through
/v1/responses (the `openai` SDK), whole and streamed."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from ember.default_model import default_model_path
from ember.entrypoints.cli import build_parser
from ember.entrypoints.serve import _chat_template
from tests.server.live import MODEL_NAME, start_server

pytestmark = pytest.mark.engine

MAX_TOKENS = 200

# Qwen3.5's way with tools, in a template of our own: the tools as JSON in a system turn with the XML
# call format shown, past calls rendered back as XML (arguments as a mapping), tool results as user turns
QWEN35_STYLE_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n' }}
{{- '<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n' }}
{{- '</function>\\n</tool_call><|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content }}
{%- for tool_call in message.tool_calls or [] %}
{{- '<tool_call>\\n<function=' + tool_call.function.name + '>\\n' }}
{%- for args_name, args_value in tool_call.function.arguments | items %}
{{- '<parameter=' + args_name + '>\\n' + (args_value | string) + '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "days", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"]},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def xml_live(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "qwen35_style.jinja"
    path.write_text(QWEN35_STYLE_TEMPLATE)
    args = build_parser().parse_args(["serve", "--chat-template", str(path)])  # --tool-call-parser auto
    live = start_server(
        default_model_path(),
        dtype="auto",
        num_threads=2,
        kv_cache_memory=0.3,
        max_model_len=2048,
        chat_template=_chat_template(args.chat_template),
        server_knobs={"tool_call_parser": args.tool_call_parser},
    )
    yield live
    live.stop()


def _check(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])  # typed: days an integer, utc a boolean
    return args


def test_the_template_chooses_the_xml_parser(xml_live):
    choice = xml_live.app.state.serving.tool_parser
    assert choice.name == "qwen3_coder" and "<function=" in choice.reason


def test_a_forced_call_comes_back_typed_whole_and_streamed_alike(xml_live):
    client = xml_live.client()
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=MAX_TOKENS)
    r = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    written = xml_live.engine.parts.loaded.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert written.startswith("<tool_call>\n<function=get_weather>\n<parameter=city>")  # the model's own format
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = _check("get_weather", call.function.arguments)
    assert isinstance(args["days"], int)

    # the SDK's stream accumulator puts the deltas together as a client does
    with client.chat.completions.stream(**kw) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert (streamed.function.name, streamed.function.arguments) == ("get_weather", call.function.arguments)
    assert [(e.name, e.arguments) for e in done] == [("get_weather", call.function.arguments)]


def test_required_calls_are_xml_and_typed(xml_live):
    r = xml_live.client().chat.completions.create(
        model=MODEL_NAME,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    _check(call.function.name, call.function.arguments)


def test_a_call_and_its_result_render_back_through_the_template(xml_live):
    """The assistant's call (arguments as JSON text, as OpenAI clients send them) goes back into the
    prompt as XML parameters, and the tool's answer as a tool response."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    r = httpx.post(xml_live.url + "/tokenize", json={"model": MODEL_NAME, "messages": turn, "tools": TOOLS})
    prompt = xml_live.engine.parts.loaded.tokenizer.decode(r.json()["tokens"], skip_special_tokens=False)
    assert (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
        in prompt
    )
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in prompt
    answer = xml_live.client().chat.completions.create(model=MODEL_NAME, messages=turn, tools=TOOLS, max_tokens=4)
    assert answer.usage.prompt_tokens == r.json()["count"]


def _forced_chat_arguments(xml_live) -> dict:
    """The arguments of the chat route's forced call: the other routes render the same prompt (the same
    messages, the same tools), so at temperature 0 their call is the same."""
    r = xml_live.client().chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=MAX_TOKENS
    )
    return json.loads(r.choices[0].message.tool_calls[0].function.arguments)


def test_the_same_forced_call_through_the_messages_api_is_a_typed_tool_use(xml_live):
    claude = anthropic.Anthropic(base_url=xml_live.url, api_key="none", max_retries=0, timeout=120)
    tools = [
        {
            k: v
            for k, v in {
                "name": f["name"],
                "description": f.get("description"),
                "input_schema": f["parameters"],
            }.items()
            if v
        }
        for f in (t["function"] for t in TOOLS)
    ]
    kw = dict(
        model="claude-sonnet-4-5", max_tokens=MAX_TOKENS, messages=ASK, tools=tools, extra_body={"temperature": 0}
    )
    kw["tool_choice"] = {"type": "tool", "name": "get_weather"}
    made = claude.messages.create(**kw)
    assert made.stop_reason == "tool_use"
    [call] = [b for b in made.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.input == _forced_chat_arguments(xml_live)
    jsonschema.validate(call.input, SCHEMAS["get_weather"])
    with claude.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [(b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [("get_weather", call.input)]


def test_the_same_forced_call_through_the_responses_api_is_a_typed_function_call(xml_live):
    client = xml_live.client()
    tools = [{"type": "function", **t["function"]} for t in TOOLS]  # as the chat tools: the template shows them
    kw = dict(model=MODEL_NAME, input=ASK, tools=tools, temperature=0, max_output_tokens=MAX_TOKENS)
    kw["tool_choice"] = {"type": "function", "name": "get_weather"}
    made = client.responses.create(**kw)
    [call] = [item for item in made.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == _forced_chat_arguments(xml_live)
    _check("get_weather", call.arguments)
    with client.responses.stream(**kw) as stream:
        final = stream.get_final_response()
    [streamed] = [item for item in final.output if item.type == "function_call"]
    assert (streamed.name, streamed.arguments) == ("get_weather", call.arguments)
