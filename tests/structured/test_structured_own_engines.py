"""Structured outputs through engines of their own (the default model, as test_structured_engine.py's):
with MTP speculation the answer equals the one without (greedy), a preempted request keeps its grammar
state, chunked prefill and prefix-cache hits keep the answer, and a reasoning parser leaves the thinking
free while the answer is constrained. Apart from test_structured_engine.py, whose tests share one
engine, so that the two files run on separate workers."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from ember import LLM
from ember.engine.planner import kv_elem_bytes
from ember.platform import resolve_dtype_name, resolve_kv_cache_dtype_name
from tests.structured.schemas import SCHEMAS
from tests.structured.test_structured_engine import assert_valid, chat, json_params

pytestmark = pytest.mark.engine  # every test here builds an engine


def test_mtp_speculation_gives_the_answer_of_no_speculation():
    """float32 (dequantized), so that a verify step's rows round as a decode step's do: in bf16 a near
    tie may go either way with or without speculation, constrained or not."""
    with_mtp = LLM(kv_cache_memory=0.2, max_model_len=1024, dtype="float32", quantization="none")
    names = ["person", "refs", "pattern_code"]
    prompts = [chat(with_mtp, SCHEMAS[n][0]) for n in names]
    params = [json_params(SCHEMAS[n][1], temperature=0, max_tokens=150) for n in names]
    spec = with_mtp.generate(prompts, params, use_tqdm=False)
    assert with_mtp.engine.parts.spec.stats.num_draft_tokens > 0  # drafts were verified against the grammar
    del with_mtp
    plain_llm = LLM(kv_cache_memory=0.2, max_model_len=1024, dtype="float32", quantization="none", enable_mtp=False)
    assert plain_llm.engine.parts.spec is None
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    for name, a, b in zip(names, spec, plain):
        assert a.outputs[0].text == b.outputs[0].text, name
        assert_valid(a.outputs[0], SCHEMAS[name][1])


def test_preempted_requests_keep_their_grammar_state():
    """A pool too small for the batch: requests are preempted (recomputed) mid-answer and still validate."""
    # ~35 blocks of 16 tokens, in whichever cache dtype --kv-cache-dtype auto means on this CPU
    # (resolve_kv_cache_dtype_name: bf16, also where the model runs float32 for want of AVX-512 BF16)
    dtype_bytes = torch.finfo(getattr(torch, resolve_dtype_name("auto", "cpu"))).bits // 8
    kv_bytes = kv_elem_bytes(resolve_kv_cache_dtype_name("auto", "auto", "cpu"), dtype_bytes)
    small = LLM(kv_cache_memory=0.006 * kv_bytes, max_model_len=512, max_num_seqs=16, enable_mtp=False)
    assert small.engine.parts.kv.num_blocks >= 32  # one 512-token sequence fits; 16 of them do not
    names = list(SCHEMAS)
    outs = small.generate(
        [chat(small, "Answer briefly and exactly. " + SCHEMAS[n][0]) for n in names],
        [json_params(SCHEMAS[n][1], temperature=0.7, seed=1, max_tokens=300) for n in names],
        use_tqdm=False,
    )
    assert small.engine.parts.scheduler.num_preemptions > 0
    for name, out in zip(names, outs):
        assert_valid(out.outputs[0], SCHEMAS[name][1])


def test_chunked_prefill_and_prefix_cache_hit():
    engine_llm = LLM(kv_cache_memory=0.5, max_model_len=2048, max_num_batched_tokens=64, enable_mtp=False)
    long_question = "Here are my notes. " + " ".join(f"Item {i} is on shelf {i % 7}." for i in range(60))
    prompt = chat(engine_llm, long_question + " Describe one item as JSON.")
    schema = SCHEMAS["array_of_objects"][1]
    first = engine_llm.generate([prompt], json_params(schema, temperature=0), use_tqdm=False)[0]
    second = engine_llm.generate([prompt], json_params(schema, temperature=0), use_tqdm=False)[0]
    assert len(first.prompt_token_ids) > 4 * 64  # several prefill chunks
    assert second.num_cached_tokens > 0
    assert_valid(first.outputs[0], schema)
    assert second.outputs[0].text == first.outputs[0].text


def test_reasoning_is_free_and_the_answer_is_constrained():
    """--reasoning-parser deepseek_r1: a prompt that opens <think> leaves the reasoning unconstrained; the
    schema holds from the token after </think> (the 135M model copies the few-shot pattern)."""
    thinker = LLM(kv_cache_memory=0.3, max_model_len=1024, reasoning_parser="deepseek_r1", enable_mtp=False)
    prompt = (
        'Q: 2+2?\n<think>\nI add the numbers.\n</think>\n{"answer": 4}\n\n'
        'Q: 3+3?\n<think>\nI add the numbers.\n</think>\n{"answer": 6}\n\nQ: 5+2?\n<think>\n'
    )
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    out = thinker.generate([prompt], json_params(schema, temperature=0, max_tokens=60), use_tqdm=False)[0].outputs[0]
    reasoning, _, answer = out.text.partition("</think>")
    assert "I add" in reasoning and out.finish_reason == "stop"
    jsonschema.validate(json.loads(answer), schema)
