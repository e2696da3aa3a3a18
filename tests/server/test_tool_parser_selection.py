"""Which tool-call parser a server uses: the one the chat template teaches, or --tool-call-parser's (vLLM's
names), and the flag's values as the launcher reads them."""

from __future__ import annotations

import argparse

import pytest

from ember.errors import ConfigError
from ember.server.launcher import add_server_args
from ember.server.tool_parsers import HermesToolParser, Qwen3XmlToolParser, parser_for_template, resolve_tool_parser

# the parts of Qwen3.5's template that matter here: its tools block and how it renders a past call
QWEN35_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}
{%- endif %}
{%- for message in messages %}{%- if message.tool_calls %}{%- for tool_call in message.tool_calls %}
{{- '<tool_call>\\n<function=' + tool_call.function.name + '>\\n' }}
{%- for args_name, args_value in tool_call.function.arguments|items %}
{{- '<parameter=' + args_name + '>\\n' }}{{- args_value | string }}{{- '\\n</parameter>\\n' }}
{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{%- endif %}{%- endfor %}"""

# Qwen3's: JSON calls in <tool_call> tags
QWEN3_TEMPLATE = """{%- if tools %}{{- '<tools>' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}
{{- '</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' }}
{%- endif %}{%- for message in messages %}{{- message.content }}{%- endfor %}"""

PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(
    "template, name",
    [(QWEN35_TEMPLATE, "qwen3_coder"), (QWEN3_TEMPLATE, "hermes"), (PLAIN_TEMPLATE, "hermes"), (None, "hermes")],
)
def test_the_template_chooses_the_parser(template, name):
    got, reason = parser_for_template(template)
    assert got == name and reason
    choice = resolve_tool_parser("auto", template)
    assert choice.name == name and choice.reason == reason


def test_both_xml_tags_are_needed_for_xml():
    assert parser_for_template("<tool_call> ... <function=f> (an example in prose)")[0] == "hermes"


@pytest.mark.parametrize(
    "flag, parser",
    [("hermes", HermesToolParser), ("qwen3_coder", Qwen3XmlToolParser), ("qwen3_xml", Qwen3XmlToolParser)],
)
def test_the_flag_beats_the_template(flag, parser):
    template = QWEN3_TEMPLATE if parser is Qwen3XmlToolParser else QWEN35_TEMPLATE
    choice = resolve_tool_parser(flag, template)
    assert choice.parser is parser and choice.reason == f"--tool-call-parser {flag}"


def test_each_parser_forces_calls_in_its_own_format():
    assert HermesToolParser.XGRAMMAR_FORMAT == "qwen_3"
    assert Qwen3XmlToolParser.XGRAMMAR_FORMAT == "qwen_3_5"


def test_an_unknown_parser_is_refused_naming_the_choices():
    with pytest.raises(ConfigError, match="auto, hermes, qwen3_coder, qwen3_xml"):
        resolve_tool_parser("mistral", None)


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(["some/model", *argv])


def test_the_flag_takes_vllms_names_and_defaults_to_auto(capsys):
    assert _serve_args().tool_call_parser == "auto"
    for name in ("hermes", "qwen3_coder", "qwen3_xml"):
        assert _serve_args("--tool-call-parser", name).tool_call_parser == name
    with pytest.raises(SystemExit):
        _serve_args("--tool-call-parser", "mistral")
    assert "invalid choice" in capsys.readouterr().err
