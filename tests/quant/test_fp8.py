"""FP8 block-wise checkpoints, below the engine: fused and tensor-parallel fp8 Linears against the dense
weights they mean, the refusals (a split that cuts a scale block, a missing or misshapen scale, a
--quantization that contradicts the checkpoint), and ember plan's count of fp8 weights."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.distributed.parallel_state import sharding
from ember.errors import ConfigError, ModelLoadError, UnsupportedModelError
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.linear import QKVLinear, RowParallelLinear
from ember.quant import fp8_blocks, process_weights_after_loading
from ember.quant.fp8_linear import FP8LinearMethod
from tests.models.tiny_models import VOCAB, build_hf_model, save_hf_model
from tests.quant.fp8_checkpoint import write_fp8_pair

H, D, HEADS, KV = 40, 12, 4, 2  # q 48 rows, k and v 24 each: parts that start mid-block for [32, 32]


def checkpoint_matrix(n: int, k: int, block, seed: int):
    q, s = fp8_blocks.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)), block)
    return q, s, fp8_blocks.dequantize_checkpoint(q, s, block)


def load_fp8(layer, name: str, q, s, block, shard=None):
    """As the loader does: the scale expanded to rows (ember.quant.fp8's stream), then the layer's own narrowing."""
    layer.load_weight("weight", q, shard)
    layer.load_weight("weight_scale_inv", fp8_blocks.expand_rows(s, q.shape[0], block[0]), shard)


@pytest.mark.parametrize("kernels", [CpuKernels(), CpuKernels.none()], ids=["cpp", "torch"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("block", [(32, 32), (128, 128), (16, 8)])
def test_fused_qkv_keeps_fp8_and_computes_the_dense_weights(tp, block, kernels):
    """q | k | v fused, each on its own block grid (so k and v start mid-block), column-split over tp ranks;
    through the C++ GEMV and through the torch reference (--no-cpu-fp8-gemv)."""
    mats = {
        s: checkpoint_matrix(n, H, block, i)
        for i, (s, n) in enumerate({"q": HEADS * D, "k": KV * D, "v": KV * D}.items())
    }
    x = torch.randn(3, H)
    for rank in range(tp):
        with sharding(rank, tp):
            layer = QKVLinear(H, D, HEADS, KV, quant_method=FP8LinearMethod(block, kernels))
        for sid, (q, s, _) in mats.items():
            load_fp8(layer, sid, q, s, block, sid)
        process_weights_after_loading(layer)
        assert layer.weight.dtype == torch.float8_e4m3fn and not hasattr(layer, "weight_scale_inv")
        assert layer.fp8_scale.numel() < layer.weight.numel() / 8  # block rows kept, not one per weight row
        assert layer.fp8_cpu_kernel == kernels.fp8_gemv
        dense = torch.cat([w.chunk(tp)[rank] for _, _, w in mats.values()])
        torch.testing.assert_close(layer(x), x @ dense.t(), rtol=1e-5, atol=1e-5)


def test_row_parallel_splits_on_block_boundaries_and_refuses_a_cut_block():
    block = (32, 32)
    q, s, dense = checkpoint_matrix(24, 128, block, 3)
    x = torch.randn(2, 128)
    total = 0
    for rank in range(2):  # 64 inputs a rank: two whole blocks each
        with sharding(rank, 2):
            layer = RowParallelLinear(128, 24, quant_method=FP8LinearMethod(block))
        load_fp8(layer, "o", q, s, block)
        process_weights_after_loading(layer)
        total = total + layer.quant_method.apply(layer, x.chunk(2, dim=1)[rank])
    torch.testing.assert_close(total, x @ dense.t(), rtol=1e-5, atol=1e-5)
    with sharding(0, 2), pytest.raises(UnsupportedModelError, match="cuts the checkpoint's 32-wide fp8 scale blocks"):
        RowParallelLinear(96, 24, quant_method=FP8LinearMethod(block))  # 48 inputs a rank


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from tests.conftest import write_tiny_tokenizer

    root = tmp_path_factory.mktemp("fp8")
    src = save_hf_model(build_hf_model("qwen3"), str(root / "src"))
    write_tiny_tokenizer(src, VOCAB)
    return write_fp8_pair(src, str(root / "fp8"), str(root / "twin"), (32, 32))


def _broken(folders, tmp_path, edit) -> str:
    import shutil

    path = str(tmp_path / "broken")
    shutil.copytree(folders[0], path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path


def _load(path, quantization="auto"):
    from ember.loader.model_loader import load_model

    return load_model(path, None, torch.float32, torch.device("cpu"), "torch", quantization)


def test_a_missing_scale_is_named(folders, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    path = _broken(folders, tmp_path, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match=re.escape(name)):
        _load(path)


def test_a_scale_of_the_wrong_shape_is_named(folders, tmp_path):
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    path = _broken(folders, tmp_path, lambda t: t.update({name: torch.ones(2, 2)}))
    with pytest.raises(ModelLoadError, match=re.escape(name) + r" has shape \[2, 2\].*needs \[2, 4\]"):
        _load(path)


def test_quantization_flags_that_contradict_the_checkpoint_are_refused(folders):
    fp8, twin = folders
    with pytest.raises(ConfigError, match="block-wise FP8 weights"):
        _load(fp8, "none")
    with pytest.raises(ConfigError, match="--quantization fp8 reads FP8 checkpoints"):
        _load(twin, "fp8")
    loaded = _load(fp8, "fp8")
    assert loaded.quantization == "fp8"
    assert {p.dtype for n, p in loaded.model.named_parameters() if n.endswith("proj.weight")} == {torch.float8_e4m3fn}


def test_plan_counts_fp8_weights_at_a_byte_and_their_scales(folders):
    """ember plan's weight bytes for the fp8 folder are within 3% of what the loaded model holds, and its fp8
    matrices count a quarter of the float32 twin's."""
    from ember.config import EngineConfig
    from ember.engine import planner

    fp8, twin = folders
    plan = planner.plan(EngineConfig(model=fp8, device="cpu", dtype="float32"), memory_gib=4)
    assert plan.quantization == "fp8"
    held = _load(fp8).weight_bytes
    assert abs(plan.weight_bytes - held) / held < 0.03, (plan.weight_bytes, held)
    with open(os.path.join(fp8, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == [32, 32]


def test_the_headers_check_names_a_table_shard_without_its_scale():
    """qwen4_exp's fp8 n-gram shards carry a per-tensor weight_scale (read by ember.layers.ple); one without it is
    named before anything loads."""
    from ember.quant.fp8 import FP8Config

    shard = "model.layers.3.ple.ple_embedding.ngram_embedding.shard_1"
    headers = {f"{shard}.weight": ("F8_E4M3", [128, 16]), f"{shard.replace('_1', '_0')}.weight": ("F8_E4M3", [128, 16])}
    headers[f"{shard.replace('_1', '_0')}.weight_scale"] = ("F32", [])
    with pytest.raises(
        ModelLoadError, match=re.escape(f"{shard}.weight_scale_inv (or a per-tensor {shard}.weight_scale)")
    ):
        FP8Config((128, 128), headers)


@pytest.mark.parametrize("tp", [1, 2])
def test_fp8_experts_load_per_expert_and_fused_names_alike(tp):
    """The MoE experts from per-expert tensors (Qwen's releases) and from transformers-5's fused [E, 2I, H] ones
    (one block grid over gate;up) compute the same dense SwiGLU experts, on each tensor-parallel rank."""
    from ember.quant.fp8_experts import FP8ExpertsMethod

    E, Hd, I, block = 3, 48, 64, (32, 32)  # H 48: a partial input block for gate;up
    g = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(E, 2 * I, Hd, generator=g) * 0.2, torch.randn(E, Hd, I, generator=g) * 0.2
    x = torch.randn(5, Hd, generator=g)
    q13, s13 = fp8_blocks.quantize(gate_up, block)  # the fused layout's grid
    q2, s2 = fp8_blocks.quantize(down, block)
    parts = {
        (e, k): fp8_blocks.quantize(w, block)
        for e in range(E)
        for k, w in (("gate", gate_up[e, :I]), ("up", gate_up[e, I:]))
    }
    method = FP8ExpertsMethod(block)
    for rank in range(tp):
        fused = method.create_experts(E, Hd, I // tp, torch.float32, "cpu", tp=(rank, tp))
        fused.load_weight("gate_up_proj", q13)
        fused.load_weight("gate_up_proj_scale_inv", fp8_blocks.expand_rows(s13, 2 * I, block[0]))
        fused.load_weight("down_proj", q2)
        fused.load_weight("down_proj_scale_inv", fp8_blocks.expand_rows(s2, Hd, block[0]))
        split = method.create_experts(E, Hd, I // tp, torch.float32, "cpu", tp=(rank, tp))
        for (e, kind), (q, s) in parts.items():
            split.load_weight(f"{e}.{kind}_proj.weight", q)
            split.load_weight(f"{e}.{kind}_proj.weight_scale_inv", fp8_blocks.expand_rows(s, I, block[0]))
        for e in range(E):
            split.load_weight(f"{e}.down_proj.weight", q2[e])
            split.load_weight(f"{e}.down_proj.weight_scale_inv", fp8_blocks.expand_rows(s2[e], Hd, block[0]))
        for experts in (fused, split):
            method.process_weights_after_loading(experts)
            assert experts.w13.dtype == torch.float8_e4m3fn and not hasattr(experts, "w13_scale_inv")
        for e in range(E):
            gu = fp8_blocks.dequantize_checkpoint(q13[e], s13[e], block).view(2, I, Hd)[:, rank * I // tp :][
                :, : I // tp
            ]
            d = fp8_blocks.dequantize_checkpoint(q2[e], s2[e], block)[:, rank * I // tp :][:, : I // tp]
            ref = (torch.nn.functional.silu(x @ gu[0].t()) * (x @ gu[1].t())) @ d.t()
            torch.testing.assert_close(fused.expert_forward(e, x), ref, rtol=1e-5, atol=1e-5)
            gate, up = (
                fp8_blocks.dequantize_checkpoint(*parts[e, k], block)[rank * I // tp :][: I // tp]
                for k in ("gate", "up")
            )
            ref = (torch.nn.functional.silu(x @ gate.t()) * (x @ up.t())) @ d.t()
            torch.testing.assert_close(split.expert_forward(e, x), ref, rtol=1e-5, atol=1e-5)
