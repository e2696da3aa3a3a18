"""Sparse MoE models under the compiled executor: their decode steps trace whole (experts in a sync-free
form, ember.layers.moe_compute) and give eager's greedy tokens and top logprobs, a dense Qwen3-MoE and the
MoE hybrids (a shared expert beside the routed ones)."""

from __future__ import annotations

import pytest

from ember import SamplingParams
from tests.engine.test_engine import make_llm
from tests.engine.test_step_executor import COMPILE, outputs
from tests.models.tiny_models import one_thread, random_prompt  # noqa: F401  (fixture)

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_compiled_equals_eager(path: str, vocab: int, freezing: bool = True, sizes=(1, 4), **kw):
    """Batches 1 (its own graph, or padded to 4 where `sizes` is (4,)), 3 (padded to 4), 4 and 5 (eager):
    same greedy tokens, logprobs within fp32 noise. Returns the compiled executor."""
    kw = dict(max_num_seqs=5, dtype="float32", **kw)
    eager = make_llm(path, **kw)
    cc = COMPILE | {"freezing": freezing, "compile_sizes": list(sizes)}
    compiled = make_llm(path, executor="compiled", compilation_config=cc, **kw)
    ex = compiled.engine.parts.runner.executor
    assert ex.name == "compiled" and ex.direct_shapes == [(s, 1) for s in sizes]  # one graph a size: no graph break
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    prompts = [[t % vocab for t in random_prompt(n, 90 + s)] for s, n in enumerate([11, 6, 19, 9, 14])]
    for n in [1, 3, 4, 5]:
        a, b = outputs(eager, prompts[:n], params), outputs(compiled, prompts[:n], params)
        for x, y in zip(a, b):
            assert x.token_ids == y.token_ids, n
            for lx, ly in zip(x.logprobs, y.logprobs):
                assert lx.keys() == ly.keys(), n
                assert all(abs(lx[t].logprob - ly[t].logprob) < 1e-4 for t in lx), n
    assert ex.compiled_steps >= 3 * 15  # batches 1, 3, 4: every decode after the first token
    return ex


@pytest.mark.engine
@pytest.mark.parametrize("form", ["gathered", "op"])
def test_compiled_qwen3_moe_equals_eager(tiny_model_dir, form, monkeypatch):
    """Dense experts run gathered_experts in the graph; "op": as experts with no gathered form (AWQ, GGUF)
    do, the ember::moe_experts op, in an unfrozen graph that is torch.compile's, not a package (the one
    test of that form with two sizes side by side)."""
    from ember.layers.moe import Experts
    from tests.models.tiny_models import VOCAB

    if form == "op":
        monkeypatch.setattr(Experts, "gathered", None)
    ex = assert_compiled_equals_eager(tiny_model_dir("qwen3_moe"), VOCAB, freezing=form == "gathered")
    assert ex.package_shapes == []


@pytest.mark.engine
@pytest.mark.parametrize("arch", ["qwen3_5_moe", "qwen3_next"])
def test_compiled_moe_hybrid_equals_eager(tiny_hybrid_dir, arch):
    """Qwen3.5-MoE at sizes 1 and 4: the MoE hybrid's batch-1 graph, and the Gated DeltaNet layers' frozen
    batch-1 graph (tests/engine/test_step_executor_hybrid.py compiles Qwen3.5's frozen graphs at batch 4
    alone). Qwen3-Next at batch 4 alone (batch 1 padded to it): each size is a compile, and a MoE
    hybrid's batch-1 graph is Qwen3.5-MoE's here."""
    from tests.models.tiny_hybrids import VOCAB

    sizes = (1, 4) if arch == "qwen3_5_moe" else (4,)
    assert_compiled_equals_eager(tiny_hybrid_dir(arch), VOCAB, sizes=sizes, block_size=16)
