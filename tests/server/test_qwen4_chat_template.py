"""reasoning_effort and the parsers for Qwen3.8-Flash-Next's kind of chat template, without an engine: how a
template's effort values are read off its source, how OpenAI's values are fitted to them (and refused), that
templates which ignore the effort or switch thinking with enable_thinking keep rendering as before (Anthropic's
`thinking` included), the Responses and Anthropic translations, and which parsers the template chooses."""

from __future__ import annotations

import pytest
import tokenizers

from ember.errors import InvalidRequestError, ParamError
from ember.loader.tokenizer import Tokenizer
from ember.server.anthropic.protocol import MessagesRequest
from ember.server.anthropic.translate import chat_request_dict
from ember.server.reasoning_choice import resolve_reasoning_parser
from ember.server.reasoning_effort import template_effort, template_kwargs
from ember.server.responses.protocol import ResponsesRequest
from ember.server.responses.translate import to_chat
from ember.server.tool_parsers import resolve_tool_parser
from tests.conftest import CHATML
from tests.models.tiny_qwen4 import CHAT_TEMPLATE

QWEN4 = CHAT_TEMPLATE.read_text()
# Qwen3 / Qwen3.5's switch: thinking on unless enable_thinking is false; no effort levels
SWITCHED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
    "{% endif %}{% endif %}"
)
# gpt-oss's kind: the effort printed as it comes, its values not spelled out in the template
VERBATIM = "Reasoning: {{ reasoning_effort | default('medium') }}\n{% for m in messages %}{{ m.content }}{% endfor %}"
# a template that compares through a name set from the effort, and takes "none" itself
ALIASED = (
    "{% set level = reasoning_effort | default('high') | lower %}"
    "{% if level in ('none', 'high') %}{{ level }}{% elif level == 'low' %}low{% endif %}"
)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _tokenizer(template: str) -> Tokenizer:
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "</s>": 1}, unk_token="[UNK]"))
    return Tokenizer(hf, bos_token_id=None, eos_token_ids=[1], chat_template=template)


def _render(template: str, effort: str | None = None, kwargs: dict | None = None) -> str:
    return _tokenizer(template).apply_chat_template(ASK, **template_kwargs(template, kwargs, effort))


def test_the_effort_values_are_read_off_the_template():
    qwen4 = template_effort(QWEN4)
    assert qwen4.reads_effort and qwen4.levels == ("low", "medium", "xhigh") and not qwen4.has_thinking_switch
    assert template_effort(ALIASED).levels == ("none", "high", "low")
    assert template_effort(VERBATIM).reads_effort and template_effort(VERBATIM).levels == ()
    switched = template_effort(SWITCHED)
    assert not switched.reads_effort and switched.has_thinking_switch
    assert template_effort("{% if %}") == template_effort("")  # does not parse: reads nothing


@pytest.mark.parametrize(
    "effort, level",
    [
        (None, "xhigh"),  # the template's default
        ("low", "low"),
        ("medium", "medium"),
        ("xhigh", "xhigh"),
        ("minimal", "low"),
        ("high", "xhigh"),  # between medium and xhigh: the higher
        ("max", "xhigh"),
    ],
)
def test_openais_efforts_are_fitted_to_the_templates_values(effort, level):
    assert f"Reasoning effort: {level}." in _render(QWEN4, effort)


def test_explicit_template_kwargs_win_verbatim():
    assert "Reasoning effort: low." in _render(QWEN4, "xhigh", {"reasoning_effort": "low"})
    kwargs = {"reasoning_effort": "high"}
    assert template_kwargs(QWEN4, kwargs, "low") == kwargs and kwargs == {"reasoning_effort": "high"}
    with pytest.raises(InvalidRequestError, match="must be one of low, medium, xhigh, not high"):
        _render(QWEN4, None, kwargs)  # the template judges an explicit value: a 400 with its message


def test_efforts_that_cannot_be_served_are_refused_by_name():
    with pytest.raises(ParamError, match="always thinks .* takes low, medium, xhigh") as e:
        template_kwargs(QWEN4, None, "none")
    assert e.value.param == "reasoning_effort"
    with pytest.raises(ParamError, match="'extreme' is not one of none, minimal, low, medium, high, xhigh, max"):
        template_kwargs(CHATML, None, "extreme")  # whatever the template: it is not OpenAI's value
    with pytest.raises(ParamError, match="no counterpart .* takes fast, slow") as e:
        template_kwargs(
            "{% if reasoning_effort in ['fast', 'slow'] %}{% endif %}", None, "low", param="reasoning.effort"
        )
    assert e.value.param == "reasoning.effort"


def test_templates_without_effort_levels_render_as_they_did():
    plain = "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    assert _render(CHATML, "high") == _render(CHATML) == plain
    assert template_kwargs(CHATML, None, "low") == {}
    # enable_thinking from the effort (vLLM's mapping), unless the request sets it
    assert _render(SWITCHED, "none").endswith("<think>\n\n</think>\n\n")
    assert _render(SWITCHED, "low").endswith("assistant\n<think>\n")
    assert _render(SWITCHED, "low", {"enable_thinking": False}).endswith("</think>\n\n")
    assert _render(VERBATIM, "high").startswith("Reasoning: high\n")  # values unknown: as given
    assert _render(ALIASED, "none") == "none" and _render(ALIASED, "minimal") == "low"


def test_the_responses_api_sends_reasoning_effort_on():
    def chat(reasoning):
        return to_chat(ResponsesRequest.model_validate({"input": "hi", "reasoning": reasoning})).chat

    assert chat({"effort": "low", "summary": "auto"}).reasoning_effort == "low"
    assert chat({"summary": "auto"}).reasoning_effort is None and chat(None).reasoning_effort is None
    with pytest.raises(ParamError, match="reasoning.effort must be a string") as e:
        chat({"effort": 3})
    assert e.value.param == "reasoning.effort"


def test_anthropics_effort_is_the_templates_and_thinking_still_switches():
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    got = chat_request_dict(MessagesRequest.model_validate(body | {"output_config": {"effort": "high"}}))
    assert got["reasoning_effort"] == "high" and got["chat_template_kwargs"] == {"enable_thinking": False}
    assert "reasoning_effort" not in chat_request_dict(MessagesRequest.model_validate(body))
    # thinking disabled stays disabled on a switchable template; on qwen4's the effort is fitted
    assert template_kwargs(SWITCHED, got["chat_template_kwargs"], "high") == {"enable_thinking": False}
    assert template_kwargs(QWEN4, got["chat_template_kwargs"], "high") == {
        "enable_thinking": False,
        "reasoning_effort": "xhigh",
    }


def test_the_template_chooses_the_xml_tool_parser_and_the_reasoning_parser():
    assert resolve_tool_parser("auto", QWEN4).name == "qwen3_coder"
    choice = resolve_reasoning_parser(None, _tokenizer(QWEN4), None)
    assert choice.name == "qwen3" and "always opens <think>" in choice.reason
    # thinking that can be switched off, or none at all: vLLM's rule, no parser unless the flag names one
    assert resolve_reasoning_parser(None, _tokenizer(SWITCHED), None).name is None
    assert resolve_reasoning_parser(None, _tokenizer(CHATML), None).name is None
    assert resolve_reasoning_parser(None, _tokenizer(CHATML), QWEN4).name == "qwen3"  # --chat-template's
    assert resolve_reasoning_parser("deepseek_r1", _tokenizer(QWEN4), None).name == "deepseek_r1"
    assert resolve_reasoning_parser(None, _tokenizer("{{ raise_exception('no') }}"), None).name is None
