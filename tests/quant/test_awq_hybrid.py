"""AWQ checkpoints of hybrid Qwen models: the projections AutoAWQ quantizes (attention q/k/v/o,
Gated DeltaNet in_proj_qkv / in_proj_z / in_proj_qkvz and out_proj, every MLP and expert, the shared
expert) load packed and run like their dequantized twins, while what must stay dense stays dense
(in_proj_b / in_proj_a or in_proj_ba, the conv, A_log, dt_bias, the router, the shared-expert gate)."""

from __future__ import annotations

import re

import pytest
import torch

from ember import LLM, SamplingParams
from ember.layers.linear import DenseMethod
from ember.quant.awq import AWQLinearMethod
from tests.models.tiny_hybrids import VOCAB, build_hybrid, save_hybrid
from tests.models.tiny_models import one_thread, random_prompt  # noqa: F401
from tests.quant.test_awq import write_awq_pair

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
QUANTIZED = re.compile(r"\.((q|k|v|o|gate|up|down)_proj|in_proj_qkvz?|in_proj_z|out_proj)\.weight$")
SKIP = ["linear_attn.in_proj_b", "linear_attn.in_proj_a", "linear_attn.in_proj_ba", "mlp.gate", "shared_expert_gate"]
SHAPE = dict(head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16)  # AWQ packs 8 outputs a word
G = 8


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe", "qwen3_5"])
def test_awq_hybrid_equals_its_dequantized_twin(arch, tmp_path):
    src = save_hybrid(build_hybrid(arch, **SHAPE), str(tmp_path / "hf"))
    awq_dir, dense_dir = write_awq_pair(src, str(tmp_path), G, skip=SKIP, quantized=QUANTIZED)
    kw = dict(
        dtype="float32",
        block_size=4,
        max_model_len=96,
        num_threads=1,
        kv_cache_memory=0.004,
        max_num_seqs=3,
        max_num_batched_tokens=11,
    )
    awq, dense = LLM(awq_dir, **kw), LLM(dense_dir, **kw)
    model = awq.engine.parts.runner.model
    gdn = next(layer.linear_attn for layer in model.model.layers if layer.is_linear)
    assert isinstance(gdn.in_proj_qkvz.quant_method, AWQLinearMethod)
    assert isinstance(gdn.out_proj.quant_method, AWQLinearMethod)
    assert isinstance(gdn.in_proj_ba.quant_method, DenseMethod)  # the gates stay dense
    assert gdn.conv_weight.dtype == torch.float32 and gdn.A_log.dtype == torch.float32
    prompts = [[t % VOCAB for t in random_prompt(n, 7 + n)] for n in (3, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    ours = awq.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = dense.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for o, r in zip(ours, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for lo, lr in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert max(abs(lo[t].logprob - lr[t].logprob) for t in lr) < 1e-3
