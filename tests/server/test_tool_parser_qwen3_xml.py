"""The Qwen3-Coder XML tool-call parser (Qwen3.5's format) on recorded model outputs: fed whole, split in
two at every character boundary and fed a character at a time, the streamed answer equals the whole one
to the byte; values typed by the tool schema; lenient reading of what models get wrong; Hermes JSON
inside <tool_call>."""

from __future__ import annotations

import json

import pytest

from ember.server.tool_parsers import Qwen3XmlToolParser, parse_tool_calls

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    "hourly": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": "number"},
                    "tags": {"type": "array", "items": {"type": "string"}},
                    "meta": {"type": "object"},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]

# Qwen3.5-style outputs, as the chat template teaches them (a newline after every tag)
WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n"
    "<parameter=hourly>\ntrue\n</parameter>\n</function>\n</tool_call>"
)
CODE = "def f(a, b):\n    return a < b and b > 0\n\n"  # ends in a blank line of its own
WRITE = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/ä x.py\n</parameter>\n"
    f"<parameter=content>\n{CODE}\n</parameter>\n<parameter=mode>\n0.5\n</parameter>\n"
    '<parameter=tags>\n["py", "demo"]\n</parameter>\n<parameter=meta>\n{"owner": null, "n": 2}\n</parameter>\n'
    "</function>\n</tool_call>"
)
NOW = "<tool_call>\n<function=now>\n</function>\n</tool_call>"

WEATHER_ARGS = {"city": "Paris", "days": 3, "unit": "celsius", "hourly": True}
WRITE_ARGS = {
    "path": "/tmp/ä x.py",
    "content": CODE,
    "mode": 0.5,
    "tags": ["py", "demo"],
    "meta": {"owner": None, "n": 2},
}

RECORDED = {
    "content then a call": (
        "I'll look it up.\n\n" + WEATHER,
        "I'll look it up.\n\n",
        [("get_weather", WEATHER_ARGS)],
    ),
    "two calls": (WEATHER + "\n" + WRITE, None, [("get_weather", WEATHER_ARGS), ("write_file", WRITE_ARGS)]),
    "a call without parameters": (NOW, None, [("now", {})]),
    "no call": ("The weather in Paris is mild; use <b>tags</b> freely.", None, []),
}


def whole(text: str, tools=TOOLS):
    return parse_tool_calls(text, Qwen3XmlToolParser, tools)


def replay(text: str, cuts: list[int], tools=TOOLS) -> tuple[str, list[dict], list[list[str]]]:
    """Feed text cut at the given positions; assemble content and calls as a client does, checking the
    streaming rules on the way. Returns (content, calls, each call's argument pieces)."""
    p = Qwen3XmlToolParser(tools)
    deltas = []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        deltas.append(p.feed(text[a:b]))
    deltas.append(p.finish())
    content, calls, pieces = "", {}, {}
    for d in deltas:
        content += d.content
        for tc in d.tool_calls:
            if "id" in tc:
                assert tc["index"] not in calls, "a call's head comes once"
                assert tc["type"] == "function" and tc["id"].startswith("call_")
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert tc["index"] in calls, "arguments before the call's head"
            piece = tc["function"].get("arguments", "")
            calls[tc["index"]]["arguments"] += piece
            if piece:
                pieces.setdefault(tc["index"], []).append(piece)
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], [pieces.get(i, []) for i in sorted(calls)]


def assert_streams_as_whole(text: str, tools=TOOLS) -> None:
    """Split in two at every boundary, and a character at a time: content and calls equal the whole
    answer's to the byte (ids aside: each parse makes its own; blank content counts as none)."""
    content, calls = whole(text, tools)
    expected = (_shown(content), [(c.name, c.arguments) for c in calls])
    for cuts in [[cut] for cut in range(1, len(text))] + [list(range(1, len(text)))]:
        got, streamed, _ = replay(text, cuts, tools)
        assert (_shown(got), [(c["name"], c["arguments"]) for c in streamed]) == expected, cuts


def _shown(content: str | None) -> str:
    return content if content and content.strip() else ""


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_recorded_outputs_whole(case):
    text, content, expected = RECORDED[case]
    got_content, calls = whole(text)
    assert got_content == (content if expected else text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("case", sorted(RECORDED))
def test_recorded_outputs_stream_as_whole_at_every_split(case):
    assert_streams_as_whole(RECORDED[case][0])


def test_arguments_are_streamed_one_parameter_at_a_time():
    content, calls, pieces = replay(WEATHER, list(range(1, len(WEATHER))))
    assert pieces[0] == ['{"city": "Paris"', ', "days": 3', ', "unit": "celsius"', ', "hourly": true', "}"]
    assert calls[0]["arguments"] == '{"city": "Paris", "days": 3, "unit": "celsius", "hourly": true}'
    _, _, pieces = replay(NOW, list(range(1, len(NOW))))
    assert pieces == [["{}"]]


def test_the_head_goes_out_as_soon_as_the_function_name_is_complete():
    p = Qwen3XmlToolParser(TOOLS)
    head = "<tool_call>\n<function=get_weather>"
    assert p.feed(head[:-1]) == type(p.feed(""))()  # `<function=get_weather` could go on: nothing yet
    d = p.feed(head[-1])
    assert d.tool_calls == [
        {
            "index": 0,
            "id": d.tool_calls[0]["id"],
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        }
    ]
    d = p.feed("\n<parameter=city>\nPar")
    assert not d  # a value goes out when it is finished
    d = p.feed("is\n</parameter>")
    assert d.tool_calls == [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]


def test_a_tag_cut_in_two_is_held_back_and_never_shown_as_content():
    p = Qwen3XmlToolParser(TOOLS)
    assert p.feed("Sure.\n<tool_").content == "Sure.\n"
    assert p.feed("call>").content == ""
    p = Qwen3XmlToolParser(TOOLS)
    assert p.feed("a <tool_x").content == "a <tool_x"  # not the tag after all


def test_values_one_newline_stripped_each_side():
    text = "<tool_call>\n<function=write_file>\n<parameter=content>\n\n  two blank lines around  \n\n</parameter>\n</function>\n</tool_call>"
    _, calls = whole(text)
    assert json.loads(calls[0].arguments) == {"content": "\n  two blank lines around  \n"}
    # without newlines the text is the value as it is (xgrammar's forced calls may write it so)
    _, calls = whole("<tool_call>\n<function=write_file>\n<parameter=path>a.py</parameter>\n</function>\n</tool_call>")
    assert json.loads(calls[0].arguments) == {"path": "a.py"}


def test_a_value_that_does_not_convert_stays_a_string_and_the_call_is_kept():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\nthree\n</parameter>\n<parameter=hourly>\nmaybe\n</parameter>\n"
        "<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>"
    )
    _, calls = whole(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Rome", "days": "three", "hourly": "maybe", "extra": "42"})  # extra: not in schema
    ]
    assert_streams_as_whole(text)
    # the same call from a request whose tools the parser was not given: every value is text
    _, calls = whole(WEATHER, tools=None)
    assert json.loads(calls[0].arguments) == {"city": "Paris", "days": "3", "unit": "celsius", "hourly": "true"}


LENIENT = {
    "no </parameter> before the next parameter": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"city": "Paris", "days": 2})],
    ),
    "no </parameter> before </function>": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
        [("get_weather", {"city": "Paris"})],
    ),
    "no </function>": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
        [("get_weather", {"city": "Paris"})],
    ),
    "no </tool_call> (the model stopped)": (
        "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</function>\n",
        [("get_weather", {"days": 4})],
    ),
    "cut off inside a value": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
        [("get_weather", {"city": "Par"})],
    ),
    "cut off in a closing tag": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n<parameter=days>3</parameter",
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "cut off in a parameter's name": (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=da",
        [("get_weather", {"city": "Paris"})],
    ),
    "two functions in one <tool_call>": (
        "<tool_call>\n<function=now>\n</function>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
        [("now", {}), ("get_weather", {"city": "Oslo"})],
    ),
    "a name whose > is missing": (
        "<tool_call>\n<function=get_weather\n<parameter=city\nParis\n</parameter>\n</function>\n</tool_call>",
        [("get_weather", {"city": "Paris"})],
    ),
    "a value with tag-like text": (
        "<tool_call>\n<function=write_file>\n<parameter=content>\n<div>a </param b</div>\n</parameter>\n</function>\n</tool_call>",
        [("write_file", {"content": "<div>a </param b</div>"})],
    ),
}


@pytest.mark.parametrize("case", sorted(LENIENT))
def test_lenient_reading(case):
    text, expected = LENIENT[case]
    content, calls = whole(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
    assert_streams_as_whole(text)


@pytest.mark.parametrize(
    "text",
    [
        "Use <tool_call>\nsome prose, no function\n</tool_call> like that.",
        "see <tool_call> the",
        "<tool_call>\n<function=get_wea",
        "<tool_call>\n\n</tool_call>",
    ],
)
def test_a_body_without_a_function_stays_content_as_written(text):
    assert whole(text) == (text, [])
    assert replay(text, list(range(1, len(text))))[:2] == (text, [])


HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


def test_hermes_json_inside_tool_call_is_accepted():
    content, calls = whole(HERMES)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris", "days": 3}')]
    assert_streams_as_whole(HERMES)


def test_both_forms_in_one_answer():
    text = "Two lookups.\n" + HERMES + "\n" + WRITE
    content, calls = whole(text)
    assert content == "Two lookups.\n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("write_file", WRITE_ARGS),
    ]
    assert_streams_as_whole(text)
