"""Structured outputs through the engine, on the embedded default model (SmolLM2-135M, as `ember serve`
runs it: packed Q4_1, MTP speculation on), whose free-running JSON is usually invalid.

Every answer is parsed and validated with jsonschema and must end with `stop`, never cut at
max_tokens: in a batch, at temperature 0 and 1, with n > 1, after preemption, across chunked
prefill and prefix-cache hits; with MTP speculation it equals the answer without (greedy)."""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest

from ember import LLM, SamplingParams, StructuredOutputsParams
from ember.errors import InvalidRequestError
from tests.structured.schemas import SCHEMAS

pytestmark = pytest.mark.engine  # every test here builds an engine

MAX_TOKENS = 400


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory=0.5, max_model_len=2048)


def chat(llm, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def json_params(schema: dict, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema), **kw)


def assert_valid(completion, schema: dict) -> None:
    assert completion.finish_reason == "stop", (completion.finish_reason, completion.text)
    jsonschema.validate(json.loads(completion.text), schema)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_schema_validates_and_stops_in_one_batch(llm, temperature):
    names = list(SCHEMAS)
    prompts = [chat(llm, SCHEMAS[n][0]) for n in names]
    params = [json_params(SCHEMAS[n][1], temperature=temperature, seed=11) for n in names]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for name, out in zip(names, outs):
        assert_valid(out.outputs[0], SCHEMAS[name][1])


def test_free_text_of_the_same_prompts_is_not_valid_json(llm):
    """The constraint is what makes them valid: unconstrained, most of these answers are not JSON of the schema."""
    names = list(SCHEMAS)
    outs = llm.generate(
        [chat(llm, SCHEMAS[n][0]) for n in names], SamplingParams(temperature=0, max_tokens=120), use_tqdm=False
    )
    valid = 0
    for name, out in zip(names, outs):
        try:
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name][1])
            valid += 1
        except (json.JSONDecodeError, jsonschema.ValidationError):
            pass
    assert valid <= len(names) // 2


def test_n_sequences_each_hold_to_the_schema(llm):
    schema = SCHEMAS["person"][1]
    out = llm.generate(
        [chat(llm, SCHEMAS["person"][0])], json_params(schema, n=4, temperature=1.0, seed=3), use_tqdm=False
    )[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert_valid(c, schema)
    assert len({c.text for c in out.outputs}) > 1  # sampled, not four copies of one


def test_regex_choice_and_grammars(llm):
    prompt = chat(llm, "What is the phone number of the office?")
    cases = [
        (StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"), lambda t: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t)),
        (
            StructuredOutputsParams(choice=["Paris", "London", 'a "quoted" one']),
            lambda t: t in ("Paris", "London", 'a "quoted" one'),
        ),
        (
            StructuredOutputsParams(grammar='root ::= ("yes" | "no") ", " [0-9] [0-9]?'),
            lambda t: re.fullmatch(r"(yes|no), [0-9][0-9]?", t),
        ),
        (StructuredOutputsParams(grammar='start: answer\nanswer: "up" | "down"'), lambda t: t in ("up", "down")),
        # Any object: keys and string values unbounded, so sampled at 0.8 this model may write one string
        # until max_tokens; greedy it closes it.
        (StructuredOutputsParams(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    outs = llm.generate(
        [prompt] * len(cases),
        [
            SamplingParams(temperature=0.0 if so.json_object else 0.8, seed=5, max_tokens=200, structured_outputs=so)
            for so, _ in cases
        ],
        use_tqdm=False,
    )
    for (so, check), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (so.kind, c.text)


def test_sampling_knobs_act_within_the_grammar(llm):
    schema = SCHEMAS["person"][1]
    prompt = chat(llm, SCHEMAS["person"][0])
    seeded = [
        json_params(schema, temperature=1.0, top_p=0.9, top_k=40, seed=42, repetition_penalty=1.3, presence_penalty=0.5)
        for _ in range(2)
    ]
    a, b = llm.generate([prompt, prompt], seeded, use_tqdm=False)
    assert a.outputs[0].text == b.outputs[0].text  # a seed still fixes the sample
    assert_valid(a.outputs[0], schema)


def test_logprobs_are_those_of_the_masked_distribution(llm):
    choices = ["alpha", "beta", "gamma"]
    out = llm.generate(
        [chat(llm, "Pick a Greek letter.")],
        SamplingParams(
            temperature=0, max_tokens=20, logprobs=20, structured_outputs=StructuredOutputsParams(choice=choices)
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text in choices
    first = out.logprobs[0]
    tok = llm.get_tokenizer()
    allowed_mass, forbidden = 0.0, 0
    for token_id, lp in first.items():
        forbidden += lp.logprob == -math.inf
        if math.isfinite(lp.logprob):
            assert any(c.startswith(tok.decode([token_id])) for c in choices), tok.decode([token_id])
            allowed_mass += math.exp(lp.logprob)
    assert forbidden > 0  # the top 20 reach past the few tokens that can start a choice
    assert allowed_mass == pytest.approx(1.0, abs=1e-3)  # all the mass is on what the grammar allows


def test_grammar_end_stops_the_request_even_under_ignore_eos(llm):
    out = llm.generate(
        [chat(llm, "Yes or no?")],
        SamplingParams(
            temperature=0,
            max_tokens=50,
            ignore_eos=True,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]),
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("yes", "no")


def test_stop_strings_still_end_a_constrained_answer(llm):
    schema = SCHEMAS["person"][1]
    out = llm.generate(
        [chat(llm, SCHEMAS["person"][0])], json_params(schema, temperature=0, stop=[","]), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "," and out.text.startswith("{")


def test_a_bad_constraint_is_refused_and_the_engine_goes_on(llm):
    for bad in (
        {"json": {"type": "nope"}},
        {"regex": "a(b"},
        {"grammar": "root ::= undefined_rule"},
        {"json": '{"type": '},
    ):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=bad), use_tqdm=False)
        assert "structured_outputs" in str(e.value)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(
        ["Say yes."],
        SamplingParams(temperature=0, max_tokens=8, structured_outputs={"choice": ["yes"]}),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.text == "yes"


def test_each_distinct_constraint_compiles_once(llm):
    schema = {
        "type": "object",
        "properties": {"unique_field_for_cache_test": {"type": "boolean"}},
        "required": ["unique_field_for_cache_test"],
    }
    before = llm.engine.structured.num_compiled
    for _ in range(3):
        llm.generate(["Answer."], json_params(schema, temperature=0, max_tokens=30), use_tqdm=False)
    assert llm.engine.structured.num_compiled == before + 1
