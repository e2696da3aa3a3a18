"""StructuredOutputsParams, grammar building, tool-call tags and the manager's verify-row masks, against
the default model's vocabulary (49,152 byte-level BPE tokens, through xgrammar's reader)."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from ember.default_model import default_model_path
from ember.errors import GrammarError, InvalidRequestError
from ember.loader.gguf import GGUFCheckpoint
from ember.request import Draft, Request
from ember.sampling import SamplingParams
from ember.structured.grammar import build_grammar
from ember.structured.manager import StructuredOutputManager, tokenizer_info
from ember.structured.tool_calls import MAX_PARALLEL_TOOL_CALLS, tool_call_structural_tag
from ember.structured_params import StructuredOutputsParams
from tests.structured.schemas import TOOLS


@pytest.fixture(scope="module")
def tokenizer():
    return GGUFCheckpoint(default_model_path()).tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return xgr.GrammarCompiler(tokenizer_info(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids))


def accepts(compiler, grammar, text: str, eos: int = 2) -> bool:
    m = xgr.GrammarMatcher(compiler.compile_grammar(grammar))
    return m.accept_string(text) and m.accept_token(eos)


# -- params ---------------------------------------------------------------------------------------
def test_params_need_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutputsParams(json="{not json")
    with pytest.raises(InvalidRequestError, match="whitespace_pattern"):
        StructuredOutputsParams(json={}, whitespace_pattern=r"[ ]?")
    with pytest.raises(InvalidRequestError, match="unknown fields"):
        StructuredOutputsParams.from_dict({"regex": "a", "backend": "outlines"})
    p = SamplingParams(structured_outputs={"json": '{"type": "integer"}'})
    assert p.structured_outputs.json == {"type": "integer"} and p.structured_outputs.kind == "json"


def test_the_cache_key_tells_constraints_apart():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    same = StructuredOutputsParams(json='{"properties": {"a": {"type": "integer"}}, "type": "object"}')
    compact = StructuredOutputsParams(json=a.json, disable_any_whitespace=True)
    assert a.key() == same.key() != compact.key()
    assert StructuredOutputsParams(regex="a").key() != StructuredOutputsParams(grammar="a").key()


# -- grammars -------------------------------------------------------------------------------------
def test_grammars_accept_what_they_should(compiler):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
    g = build_grammar(StructuredOutputsParams(json=schema))
    assert accepts(compiler, g, '{"n": 5}') and accepts(compiler, g, '{\n  "n": 5\n}')
    assert not accepts(compiler, g, '{"n": 10}') and not accepts(compiler, g, '{"n": 5, "extra": 1}')
    compact = build_grammar(StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    assert accepts(compiler, compact, '{"n": 5}')  # one fixed separator each, ", " and ": "
    assert not accepts(compiler, compact, '{ "n": 5}') and not accepts(compiler, compact, '{"n":  5}')
    choice = build_grammar(StructuredOutputsParams(choice=['say "hi"', "back\\slash", "été"]))
    for c in ['say "hi"', "back\\slash", "été"]:
        assert accepts(compiler, choice, c)
    assert not accepts(compiler, choice, "say hi")
    obj = build_grammar(StructuredOutputsParams(json_object=True))
    assert accepts(compiler, obj, '{"any": [1, {"x": null}]}') and not accepts(compiler, obj, "[1]")


def test_whitespace_runs_are_bounded_by_default(compiler):
    g = build_grammar(
        StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    )
    bound = StructuredOutputsParams(json={}).max_whitespace
    assert accepts(compiler, g, "{" + " " * bound + '"a": 1}')
    assert not accepts(compiler, g, "{" + " " * (bound + 1) + '"a": 1}')


@pytest.mark.parametrize(
    "fields, param, says",
    [
        ({"json": {"type": "nope"}}, "json", "Unsupported type"),
        ({"json": {"type": "string", "pattern": "(unclosed"}}, "json", "cannot be compiled"),
        ({"regex": "a(b"}, "regex", "parenthesis"),
        ({"grammar": "root ::= missing"}, "grammar", "not defined"),
        ({"grammar": "not a grammar at all"}, "grammar", "no `::=` rule"),
        ({"structural_tag": '{"type": "structural_tag"}'}, "structural_tag", "cannot be compiled"),
    ],
)
def test_a_bad_constraint_names_the_field_and_the_problem(fields, param, says):
    with pytest.raises(GrammarError) as e:
        build_grammar(StructuredOutputsParams(**fields))
    assert e.value.param == param and says in str(e.value)
    assert "/project/" not in str(e.value)  # the library's source location is not the client's business


def test_tool_call_tags_hold_hermes_calls(compiler):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    other = '<tool_call>\n{"name": "search_flights", "arguments": {"origin": "CDG", "destination": "JFK", "passengers": 2}}\n</tool_call>'
    required = xgr.Grammar.from_structural_tag(tool_call_structural_tag(TOOLS, "required"))
    assert accepts(compiler, required, call) and accepts(compiler, required, call + "\n" + other)
    assert not accepts(compiler, required, "") and not accepts(compiler, required, "Sure! " + call)
    assert not accepts(compiler, required, call.replace("celsius", "kelvin"))
    assert accepts(compiler, required, "\n".join([call] * MAX_PARALLEL_TOOL_CALLS))
    assert not accepts(compiler, required, "\n".join([call] * (MAX_PARALLEL_TOOL_CALLS + 1)))
    single = xgr.Grammar.from_structural_tag(tool_call_structural_tag(TOOLS, "required", parallel_tool_calls=False))
    assert accepts(compiler, single, other) and not accepts(compiler, single, call + "\n" + other)
    named = xgr.Grammar.from_structural_tag(
        tool_call_structural_tag(TOOLS, {"type": "function", "function": {"name": "search_flights"}})
    )
    assert accepts(compiler, named, other) and not accepts(compiler, named, call)
    with pytest.raises(InvalidRequestError, match="not in tools"):
        tool_call_structural_tag(TOOLS, {"type": "function", "function": {"name": "nope"}})


def test_tool_call_tags_hold_qwen_xml_calls_that_the_xml_parser_reads_back(compiler):
    from ember.server.tool_parsers import Qwen3XmlToolParser, parse_tool_calls

    call = (
        "<tool_call>\n<function=search_flights>\n<parameter=origin>\nCDG\n</parameter>\n"
        "<parameter=destination>\nJFK\n</parameter>\n<parameter=passengers>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    other = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>"
    )
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'

    def tag(choice, **kw):
        return xgr.Grammar.from_structural_tag(tool_call_structural_tag(TOOLS, choice, model_format="qwen_3_5", **kw))

    required = tag("required")
    assert accepts(compiler, required, call) and accepts(compiler, required, call + "\n" + other)
    assert not accepts(compiler, required, hermes) and not accepts(compiler, required, "Sure! " + call)
    assert not accepts(compiler, required, call.replace(">\n2\n<", ">\n12\n<"))  # passengers: at most 9
    assert not accepts(compiler, tag("required", parallel_tool_calls=False), call + "\n" + other)
    named = tag({"type": "function", "function": {"name": "get_weather"}})
    assert accepts(compiler, named, other) and not accepts(compiler, named, call)
    content, calls = parse_tool_calls(call + "\n" + other, Qwen3XmlToolParser, TOOLS)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("search_flights", {"origin": "CDG", "destination": "JFK", "passengers": 2}),
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
    ]
    with pytest.raises(ValueError, match="no tool-call structural tag"):
        tool_call_structural_tag(TOOLS, "required", model_format="mistral")


# -- the manager's masks for a verify step ---------------------------------------------------------
class _Out:
    def __init__(self, scheduled, drafts):
        self.scheduled, self.drafts = scheduled, drafts


def test_verify_rows_follow_the_drafts_and_leave_the_matcher_where_it_was(tokenizer):
    mgr = StructuredOutputManager(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    prompt = tokenizer.encode("Answer:")
    req = Request("r", prompt, SamplingParams(structured_outputs={"choice": ["yes please", "no thanks"]}))
    mgr.add_request([req], prompt)
    yes, please = (
        tokenizer.encode("yes", add_special_tokens=False),
        tokenizer.encode(" please", add_special_tokens=False),
    )
    drafts = Draft(yes + please)
    req.num_computed_tokens = len(prompt) - 1  # a decode step: 1 + d rows sample
    masks = mgr.step_masks(_Out([(req, 1 + len(drafts))], {"r": drafts}))
    bits = masks.rows["r"]
    assert bits.shape[0] == 1 + len(drafts)

    def allowed(row: int, token: int) -> bool:
        return bool((bits[row, token // 32] >> (token % 32)) & 1)

    assert allowed(0, yes[0]) and not allowed(0, please[0])  # row 0: the answer's start
    assert allowed(len(yes), please[0])  # after "yes": " please"
    assert allowed(len(drafts), tokenizer.eos_token_ids[0]) and not allowed(len(drafts), yes[0])  # done: only EOS
    # nothing was accepted for good: the matcher still stands at the start
    for t in yes + please:
        assert mgr.accept(req, t) == (True, False)
    assert mgr.accept(req, tokenizer.eos_token_ids[0]) == (True, True)


def test_a_refused_draft_leaves_the_rows_after_it_open(tokenizer):
    mgr = StructuredOutputManager(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    prompt = tokenizer.encode("Answer:")
    req = Request("r", prompt, SamplingParams(structured_outputs={"regex": "[0-9]+"}))
    mgr.add_request([req], prompt)
    bad = tokenizer.encode("hello", add_special_tokens=False)[:1]
    drafts = Draft(bad + tokenizer.encode("7", add_special_tokens=False))
    req.num_computed_tokens = len(prompt) - 1
    bits = mgr.step_masks(_Out([(req, 1 + len(drafts))], {"r": drafts})).rows["r"]
    assert not (bits[0, bad[0] // 32] >> (bad[0] % 32)) & 1  # the draft gets probability 0 in row 0
    assert bool((bits[1:] == -1).all())  # rows after it are never used: left open
    assert isinstance(bits, torch.Tensor) and bits.dtype == torch.int32


def test_a_prefill_chunk_gets_no_mask(tokenizer):
    mgr = StructuredOutputManager(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    prompt = tokenizer.encode("a long prompt of several tokens")
    req = Request("r", prompt, SamplingParams(structured_outputs={"regex": "x"}))
    mgr.add_request([req], prompt)
    assert mgr.step_masks(_Out([(req, 2)], {})) is None  # 2 of the prompt's tokens: nothing samples


def test_reasoning_delays_the_constraint_until_the_answer(tokenizer):
    mgr = StructuredOutputManager(
        tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids, reasoning_parser="deepseek_r1"
    )
    opened = tokenizer.encode("Question?\n<think>\n")
    closed = tokenizer.encode("Question?\n<think>\n\n</think>\n\n")
    a = Request("a", opened, SamplingParams(structured_outputs={"regex": "[0-9]"}))
    b = Request("b", closed, SamplingParams(structured_outputs={"regex": "[0-9]"}))
    mgr.add_request([a], opened)
    mgr.add_request([b], closed)
    assert not a.grammar.active and b.grammar.active
    a.num_computed_tokens = a.num_tokens - 1
    assert mgr.step_masks(_Out([(a, 1)], {})) is None  # thinking: free text

    class _Detok:
        output_text = ""

    a.detokenizer = _Detok()
    for piece in ["I think", " hard.</th", "ink>"]:
        _Detok.output_text += piece
        assert mgr.accept(a, 0) == (True, False)
    assert a.grammar.active  # the answer starts with the next token
    assert mgr.step_masks(_Out([(a, 1)], {})) is not None


# -- keywords the library would not enforce ----------------------------------------------------------
@pytest.mark.parametrize(
    "schema, keyword, accepted_invalid",
    [
        ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "[1, 1]"),
        (
            {
                "type": "object",
                "properties": {"k": {"type": "string"}, "v": {"type": "integer"}},
                "required": ["k", "v"],
                "if": {"properties": {"k": {"const": "a"}}},
                "then": {"properties": {"v": {"minimum": 100}}},
            },
            "if",
            '{"k": "a", "v": 1}',
        ),
        ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 7}}, "contains", "[1]"),
        ({"type": "object", "properties": {"x": {"not": {"type": "string"}}}, "required": ["x"]}, "not", '{"x": "s"}'),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "dependentRequired": {"a": ["b"]},
            },
            "dependentRequired",
            '{"a": 1}',
        ),
        ({"type": "number", "multipleOf": 0.5}, "multipleOf", "0.3"),
        (
            {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "integer"}]},
            "allOf",
            '{"a": 1}',
        ),
    ],
)
def test_keywords_the_library_ignores_are_refused(compiler, schema, keyword, accepted_invalid):
    # what the library does with them: compiles, then lets an answer through that breaks the keyword
    import jsonschema

    assert accepts(compiler, xgr.Grammar.from_json_schema(schema), accepted_invalid)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(accepted_invalid), schema)
    with pytest.raises(GrammarError, match=f"`{keyword}`"):
        build_grammar(StructuredOutputsParams(json=schema))


def test_plain_all_of_shapes_are_merged_and_enforced(compiler):
    one = {
        "type": "object",
        "properties": {"p": {"allOf": [{"$ref": "#/$defs/pt"}], "description": "a point"}},
        "required": ["p"],
        "$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
    }
    g = build_grammar(StructuredOutputsParams(json=one))
    assert accepts(compiler, g, '{"p": {"x": 1}}') and not accepts(compiler, g, '{"p": {"y": 1}}')
    union = {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ]
    }
    g = build_grammar(StructuredOutputsParams(json=union))
    assert accepts(compiler, g, '{"a": 1, "b": true}') and not accepts(compiler, g, '{"a": 1}')
    # a property called like a keyword is a name, not a keyword
    named = {
        "type": "object",
        "properties": {"not": {"type": "integer"}, "if": {"type": "string"}},
        "required": ["not"],
    }
    assert accepts(compiler, build_grammar(StructuredOutputsParams(json=named)), '{"not": 3}')


def test_a_tool_without_parameters_takes_an_empty_object(compiler):
    tools = [{"type": "function", "function": {"name": "now"}}]
    g = xgr.Grammar.from_structural_tag(tool_call_structural_tag(tools, "required"))
    assert accepts(compiler, g, '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert not accepts(compiler, g, '<tool_call>\n{"name": "now", "arguments": "soon"}\n</tool_call>')
    unique = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}},
            },
        }
    ]
    with pytest.raises(InvalidRequestError, match="parameters of tool 'f'.*uniqueItems"):
        tool_call_structural_tag(unique, "required")
