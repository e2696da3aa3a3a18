"""The reasoning splitter (--reasoning-parser qwen3 / deepseek_r1): whole and streamed agree, tags split
across deltas are held back, the prompt decides where the output starts."""

from __future__ import annotations

import pytest

from ember.errors import ConfigError
from ember.structured.reasoning import ReasoningSplitter, split_reasoning, starts_in_reasoning


def streamed(parser: str, prompt: str, text: str, step: int) -> tuple[str, str]:
    s = ReasoningSplitter(parser, prompt)
    r, c = [], []
    for i in range(0, len(text), step):
        dr, dc = s.feed(text[i : i + step])
        r.append(dr)
        c.append(dc)
    dr, dc = s.finish()
    return "".join(r) + dr, "".join(c) + dc


CASES = [
    # parser, prompt tail, output, (reasoning, content)
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me see.\n</think>\n\nParis.", ("\nLet me see.\n", "\n\nParis.")),
    ("qwen3", "<|im_start|>assistant\n", "Paris.", (None, "Paris.")),
    (
        "qwen3",
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "Paris <think> is a tag",
        (None, "Paris <think> is a tag"),
    ),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Hmm.\n</think>\nParis.", ("Hmm.\n", "\nParis.")),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Still thinking when cut", ("Still thinking when cut", None)),
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Add.\n</think>\n4", ("Add.\n", "\n4")),
    ("deepseek_r1", "<｜Assistant｜>", "<think>Add.</think>4", ("Add.", "4")),
    ("deepseek_r1", "<｜Assistant｜>", "no end tag", ("no end tag", None)),
]


@pytest.mark.parametrize("parser, prompt, text, expected", CASES)
def test_whole_and_streamed_split_agree(parser, prompt, text, expected):
    assert split_reasoning(parser, prompt, text) == expected
    for step in (1, 2, 3, 7):
        r, c = streamed(parser, prompt, text, step)
        assert ((r or None), (c or None)) == expected, step


def test_a_partial_tag_is_held_back_until_decided():
    s = ReasoningSplitter("deepseek_r1", "<think>\n")
    assert s.feed("abc</th") == ("abc", "")
    assert s.feed("ink>ok") == ("", "ok")
    s = ReasoningSplitter("deepseek_r1", "<think>\n")
    assert s.feed("a</tx") == ("a</tx", "")  # not the tag after all


def test_where_the_output_starts():
    assert starts_in_reasoning("qwen3", "user\n<think>\n") is True
    assert starts_in_reasoning("qwen3", "<think>\n\n</think>\n\n") is False
    assert starts_in_reasoning("qwen3", "no tags") is None
    assert starts_in_reasoning("deepseek_r1", "no tags") is True


def test_an_unknown_parser_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="qwen3, deepseek_r1"):
        ReasoningSplitter("granite", "")


CALL = "<tool_call>\n<function=f>\n</function>\n</tool_call>"
IMPLICIT = [
    # prompt tail, output, (reasoning, content): with tools, <tool_call> ends the reasoning and starts the content
    ("<think>\n", "I should call f.\n" + CALL, ("I should call f.\n", CALL)),
    ("<think>\n", CALL, (None, CALL)),
    ("<think>\n", "Hmm.\n</think>\n\n" + CALL, ("Hmm.\n", "\n\n" + CALL)),  # </think> first: as before
    ("<think>\n", "Hmm, <tool_ is not a tag.\n</think>\nok", ("Hmm, <tool_ is not a tag.\n", "\nok")),
    ("", "<think>\nPlan.\n" + CALL, ("\nPlan.\n", CALL)),  # qwen3 with the model opening <think>
]


@pytest.mark.parametrize("prompt, text, expected", IMPLICIT)
def test_a_tool_call_before_the_end_tag_ends_the_reasoning(prompt, text, expected):
    ends = ("<tool_call>",)
    assert split_reasoning("qwen3", prompt, text, ends) == expected
    for cut in range(1, len(text)):  # split in two at every boundary
        s = ReasoningSplitter("qwen3", prompt, ends)
        r1, c1 = s.feed(text[:cut])
        r2, c2 = s.feed(text[cut:])
        r3, c3 = s.finish()
        assert ((r1 + r2 + r3) or None, (c1 + c2 + c3) or None) == expected, cut


def test_without_tools_a_tool_call_tag_stays_in_the_reasoning():
    assert split_reasoning("qwen3", "<think>\n", "I might " + CALL) == ("I might " + CALL, None)


def test_a_partial_tool_call_tag_is_held_back_in_the_reasoning():
    s = ReasoningSplitter("qwen3", "<think>\n", ("<tool_call>",))
    assert s.feed("Plan.<tool_") == ("Plan.", "")
    assert s.feed("call>") == ("", "<tool_call>")
