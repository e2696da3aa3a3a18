"""A thinking model's reasoning and its tool calls through the chat path's two readers (the streamed
choice and the whole message): Qwen3.5 opens a call inside its think block, the call ends the
reasoning, both answers agree at every split, and the reasoning goes out under both field names."""

from __future__ import annotations

import json

import pytest

from ember.server.chat import _StreamedChoice, _take_tool_calls, reasoning_fields
from ember.server.tool_parsers import HermesToolParser, Qwen3XmlToolParser
from ember.structured.reasoning import ReasoningSplitter

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    }
]
THOUGHT = "The user wants the weather in Paris.\nI will call get_weather.\n"
XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
PROMPT_TAIL = "<|im_start|>assistant\n<think>\n"  # Qwen3.5's generation prompt opens the reasoning


def _splitter(parser_class) -> ReasoningSplitter:
    return ReasoningSplitter("qwen3", PROMPT_TAIL, parser_class.ENDS_REASONING)


def whole(parser_class, text: str) -> tuple[dict, str | None]:
    splitter = _splitter(parser_class)
    splitter.feed(text)
    splitter.finish()
    message = {"content": splitter.content or None, "tool_calls": [], **reasoning_fields(splitter.reasoning or None)}
    reason = _take_tool_calls(message, splitter.content, "stop", parser_class(TOOLS))
    return message, reason


def streamed(parser_class, text: str, cuts: list[int]) -> tuple[dict, str | None]:
    choice = _StreamedChoice(_splitter(parser_class), parser_class(TOOLS), include_reasoning=True)
    bounds = list(zip([0, *cuts], [*cuts, len(text)]))
    reasoning, content, calls, reason = "", "", {}, None
    for i, (a, b) in enumerate(bounds):
        d, reason = choice.delta(text[a:b], "stop" if i == len(bounds) - 1 else None)
        assert d.get("reasoning") == d.get("reasoning_content")  # both names, the same text
        reasoning += d.get("reasoning") or ""
        content += d.get("content") or ""
        for tc in d.get("tool_calls", []):
            slot = calls.setdefault(tc["index"], {"name": None, "arguments": ""})
            slot["name"] = tc["function"].get("name") or slot["name"]
            slot["arguments"] += tc["function"].get("arguments", "")
    return {"reasoning": reasoning or None, "content": content or None, "calls": list(calls.values())}, reason


@pytest.mark.parametrize("parser_class, call", [(Qwen3XmlToolParser, XML_CALL), (HermesToolParser, HERMES_CALL)])
def test_a_call_inside_the_think_block_ends_the_reasoning(parser_class, call):
    text = THOUGHT + call
    message, reason = whole(parser_class, text)
    assert reason == "tool_calls"
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    assert message["content"] is None
    calls = message["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 2})
    ]
    expected = {
        "reasoning": THOUGHT,
        "content": None,
        "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls],
    }
    for cut in range(1, len(text)):
        assert streamed(parser_class, text, [cut]) == (expected, "tool_calls"), cut
    assert streamed(parser_class, text, list(range(1, len(text)))) == (expected, "tool_calls")


def test_the_end_tag_still_ends_the_reasoning_first():
    text = THOUGHT + "</think>\n\nLet me check.\n" + XML_CALL
    message, reason = whole(Qwen3XmlToolParser, text)
    assert message["reasoning"] == THOUGHT and message["content"] == "\n\nLet me check.\n"
    assert reason == "tool_calls" and len(message["tool_calls"]) == 1
    for cut in range(1, len(text), 3):
        got, _ = streamed(Qwen3XmlToolParser, text, [cut])
        assert (got["reasoning"], got["content"]) == (THOUGHT, "\n\nLet me check.\n"), cut
