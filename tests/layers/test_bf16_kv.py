"""--kv-cache-dtype bfloat16 under float32 activations (what a CPU without AVX-512 BF16 computes in): the
pool holds twice the tokens of a float32 cache in the same memory, and a step that reads the cache (decodes,
later prefill chunks) differs from the float32-cache step only by K/V rounded to bf16 as they are stored,
on the reference backend and on ember's C++ kernels alike."""

from __future__ import annotations

import pytest
import torch

from ember import SamplingParams
from ember.engine.planner import kv_elem_bytes
from tests.engine.test_engine import kv_gib, make_llm
from tests.models.tiny_models import random_prompt

pytestmark = pytest.mark.engine


def test_planner_counts_two_bytes_an_element():
    assert kv_elem_bytes("bfloat16", 4) == kv_elem_bytes("bfloat16", 2) == 2
    assert kv_elem_bytes("auto", 4) == 4 and kv_elem_bytes("fp8", 4) == 1


def test_auto_is_bf16_where_float32_is_the_cpus_limit(monkeypatch):
    """--kv-cache-dtype auto: bfloat16 where --dtype auto ran float32 for want of AVX512-BF16 (and the
    planner counts 2 B); the model's dtype where it is bf16, on CUDA, or where float32 was asked for."""
    from ember import platform
    from ember.platform import resolve_kv_cache_dtype_name as kv_name

    monkeypatch.setattr(platform, "cpu_has_avx512_bf16", lambda: False)
    assert kv_name("auto", "auto", "cpu") == "bfloat16"
    assert kv_name("auto", "float32", "cpu") == "auto" and kv_name("auto", "auto", "cuda") == "auto"
    assert kv_name("fp8", "auto", "cpu") == "fp8" and kv_name("bfloat16", "float32", "cpu") == "bfloat16"
    monkeypatch.setattr(platform, "cpu_has_avx512_bf16", lambda: True)
    assert kv_name("auto", "auto", "cpu") == "auto"


def test_a_bf16_cache_under_float32_is_float32_attention_over_bf16_values(tiny_model_dir):
    """The reference backend and ember's C++ kernels over a bf16 cache are each within bf16's rounding of the
    reference over a float32 cache (the two differ by ~6e-3 where one attends to a chunk's own keys as computed
    and the other as stored)."""
    path = tiny_model_dir("qwen3")
    prompts = [random_prompt(n, seed) for seed, n in enumerate([5, 23, 40])]
    # 7-token steps: the later prefill chunks read earlier ones from the cache, as every decode does
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)
    runs = {}
    for backend, kvd in (("torch", "auto"), ("torch", "bfloat16"), ("cpu", "bfloat16")):
        llm = make_llm(
            path, kv_cache_dtype=kvd, attention_backend=backend, max_num_batched_tokens=7, max_num_seqs=3,
            kv_cache_memory=kv_gib(path, 256, 4),
        )  # fmt: skip
        assert llm.engine.parts.runner.kv_caches[0].dtype == (torch.float32 if kvd == "auto" else torch.bfloat16)
        runs[backend, kvd] = (
            llm.engine.parts.kv.num_blocks,
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False),
        )
        llm.close()
    assert runs["torch", "bfloat16"][0] == 2 * runs["torch", "auto"][0] == 512
    assert _compare(runs["torch", "auto"][1], runs["torch", "bfloat16"][1], 5e-2) >= 30
    assert _compare(runs["torch", "auto"][1], runs["cpu", "bfloat16"][1], 5e-2) >= 30


def _compare(ref, got, tol: float) -> int:
    """The logprobs both runs report at each step of the same text so far agree within tol; how many were compared
    (past a flip, a near tie, the two continue from different text)."""
    compared = 0
    for a, b in zip(ref, got, strict=True):
        a, b = a.outputs[0], b.outputs[0]
        for i in range(len(a.token_ids)):
            if b.token_ids[:i] != a.token_ids[:i]:
                break
            common = set(a.logprobs[i]) & set(b.logprobs[i])
            assert common, (i, a.logprobs[i], b.logprobs[i])
            for tok in common:
                assert abs(a.logprobs[i][tok].logprob - b.logprobs[i][tok].logprob) < tol, (i, tok)
                compared += 1
    return compared
