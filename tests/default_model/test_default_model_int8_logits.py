"""The default model's int8-activation prefill (--cpu-int8-activations) against its exact fp32 logits
(the engine: the `llm` fixture of tests/default_model/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from ember import LLM

pytestmark = pytest.mark.engine  # every test here builds an engine


@torch.inference_mode()
def _all_logits(engine, ids: list[int]) -> torch.Tensor:
    """float32 logits at every position of one prompt, prefilled in one step through the engine's pool."""
    from ember.engine.scheduler import SchedulerOutput
    from ember.request import Request

    req = Request("logits", ids, sampling_params=None)
    assert engine.parts.kv.allocate_slots(req, len(ids))
    try:
        b = engine.parts.runner.prepare(SchedulerOutput(scheduled=[(req, len(ids))]))
        hidden = engine.parts.runner.model(b.input_ids, b.positions, engine.parts.runner.kv_caches, b.meta)
        return engine.parts.runner.model.compute_logits(hidden).float()
    finally:
        engine.parts.kv.free(req)


@pytest.mark.skipif(
    not __import__("ember.kernels.cpu_tiled_gemv", fromlist=["x"]).has_q8(),
    reason="the int8-activation path needs AVX-512 BF16, VNNI and VBMI",
)
def test_int8_activations_stay_near_fp32_logits(llm):
    """The default bf16 engine on a VNNI CPU prefills through int8 x per group of 32
    (--cpu-int8-activations). Against the exact fp32 model at every position of 4 held-out pydoc
    texts: its logits move at most ~2.5x what bf16 x alone moves them (measured: median of the
    per-position max |difference| 0.70 vs 0.33, argmax agreeing at 95.9% vs 97.5% of 1020
    positions), and it really is another path (its logits differ from bf16 x's)."""
    from ember.train.calibration import pydoc_split

    tok = llm.engine.parts.loaded.tokenizer
    prompts = [tok.encode(t)[:160] for t in pydoc_split("eval")[:4]]
    ref = [_all_logits(llm.engine, p) for p in prompts]
    stats = {}
    for name, kw in (("int8 x", {}), ("bf16 x", {"cpu_int8_activations": False})):
        eng = LLM(dtype="bfloat16", kv_cache_memory=0.05, max_model_len=512, enable_mtp=False, **kw).engine
        got = [_all_logits(eng, p) for p in prompts]
        err = torch.cat([(g - r).abs().amax(dim=1) for g, r in zip(got, ref)])
        agree = sum((g.argmax(1) == r.argmax(1)).sum().item() for g, r in zip(got, ref)) / err.numel()
        stats[name] = (err.median().item(), agree, got)
    (e8, a8, g8), (e16, a16, g16) = stats["int8 x"], stats["bf16 x"]
    assert e8 <= 3 * e16 and e8 < 1.5, (e8, e16)
    assert a8 >= 0.93 and a8 >= a16 - 0.04, (a8, a16)
    assert any(not torch.equal(a, b) for a, b in zip(g8, g16))
