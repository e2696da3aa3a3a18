"""Round-to-nearest 8-bit tiles for dense Linears / an own LM head (the MTP draft layer on CPU)."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_tiled_gemv
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.linear import DenseMethod
from ember.quant.gemm_dispatch import INT4_KERNEL_MAX_ROWS as KERNEL_MAX_ROWS
from ember.quant.rtn_int4 import rtn_affine
from ember.quant.rtn_tiled import RTNTiledHead, RTNTiledMethod, pack_module_tiled
from tests.quant.test_rtn_int4 import Tiny

# This project's machines (and CI's) have been Zen4 (the kernel takes bf16) and Zen3 (AVX2: float32);
# a CPU with neither packs the drafter to int4 instead (test_rtn_int4).
pytestmark = pytest.mark.skipif(cpu_tiled_gemv.x_dtype() is None, reason="the tiled GEMV needs AVX-512 BF16 or AVX2")
X = cpu_tiled_gemv.x_dtype()  # the layer dtype this machine's build packs
OTHER = torch.float32 if X == torch.bfloat16 else torch.bfloat16


def test_rtn8_codes_reconstruct_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(128, 96) * 0.05
    q, scale, offset = rtn_affine(w, 32, bits=8)
    assert q.dtype == torch.uint8 and q.max() == 255 and q.min() == 0
    back = (q.float().view(128, 3, 32) * scale[..., None] + offset[..., None]).view(128, 96)
    assert ((back - w).abs().view(128, 3, 32) <= scale[..., None] / 2 + 1e-7).all()


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    q, scale, offset = rtn_affine(w, 32, bits=8)
    N, K = w.shape
    return (q.float().view(N, K // 32, 32) * scale[..., None] + offset[..., None]).view(N, K)


@pytest.mark.parametrize("rows", [1, 3, KERNEL_MAX_ROWS + 5])  # the kernel, and the dense rebuild above it
def test_pack_module_runs_the_dequantized_math(rows):
    torch.manual_seed(1)
    m = Tiny(X)
    w_proj, w_head = m.proj.weight.data.clone(), m.head.weight.data.clone()
    x = torch.randn(rows, 64, dtype=X)
    dense_h = m.proj(x)
    saved = pack_module_tiled(m)
    assert saved > 0 and not hasattr(m.proj, "weight") and isinstance(m.proj.quant_method, RTNTiledMethod)
    assert not hasattr(m.odd, "weight")  # 40 rows: the tiles pad to 48, unlike the int4 kernel's 64
    assert isinstance(m.head.quant_method, RTNTiledHead)
    h = m.proj(x)
    assert h.dtype == X and h.shape == (rows, 128)
    ref = x.float() @ _dequantized(w_proj.float()).t() + m.proj.bias.float()
    assert torch.allclose(h.float(), ref, atol=2e-2, rtol=1e-2)
    # 8 bits: much closer to the dense layer than int4's 0.1 of the range (test_rtn_int4)
    assert (h.float() - dense_h.float()).abs().max() < 0.02 * dense_h.float().abs().max()
    logits = m.head(h)
    assert logits.dtype == torch.float32 and logits.shape == (rows, 192)
    ref_logits = h.float() @ _dequantized(w_head.float()).t()
    assert torch.allclose(logits, ref_logits, atol=2e-2, rtol=1e-2)
    assert m.odd(x).shape == (rows, 40)


def test_other_dtype_modules_and_a_disabled_kernel_are_left_alone():
    m = Tiny(OTHER)
    assert pack_module_tiled(m) == 0 and isinstance(m.proj.quant_method, DenseMethod) and m.head.quant_method is None
    m = Tiny(X)
    assert pack_module_tiled(m, CpuKernels(tiled_gemv=False)) == 0  # --no-cpu-tiled-gemv
    assert isinstance(m.proj.quant_method, DenseMethod)


@pytest.mark.parametrize("rows", [1, 5])
def test_pack_experts_runs_each_routed_experts_dequantized_math(rows):
    """A MoE draft layer's stacked experts (qwen4_exp's MTP) as 8-bit tiles: the routed experts' SwiGLU over
    the dequantized codes, weighted; another dtype's are left dense."""
    import torch.nn.functional as F

    from ember.layers.moe import Experts
    from ember.quant.gguf_quant import GGUFExperts
    from ember.quant.rtn_tiled import pack_experts_tiled

    torch.manual_seed(2)
    E, H, I, k = 6, 64, 96, 2
    m = torch.nn.Module()
    m.mlp = torch.nn.Module()
    m.mlp.experts = Experts(E, H, I, X)
    m.other = torch.nn.Module()
    m.other.experts = Experts(E, H, I, OTHER)
    for ex in (m.mlp.experts, m.other.experts):
        ex.w13.data.normal_(0, 0.05)
        ex.w2.data.normal_(0, 0.05)
    w13, w2 = m.mlp.experts.w13.data.float().clone(), m.mlp.experts.w2.data.float().clone()
    saved = pack_experts_tiled(m)
    assert saved > 0 and isinstance(m.mlp.experts, GGUFExperts) and isinstance(m.other.experts, Experts)
    x = torch.randn(rows, H, dtype=X)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, k), -1).to(X)
    y = m.mlp.experts(x, ids, weights)
    ref = torch.zeros(rows, H)
    for t in range(rows):
        for j in range(k):
            e = int(ids[t, j])
            gate, up = (x[t].float() @ _dequantized(w13[e]).t()).chunk(2)
            ref[t] += weights[t, j].float() * (F.silu(gate) * up) @ _dequantized(w2[e]).t()
    assert y.dtype == X and torch.allclose(y.float(), ref, atol=2e-3, rtol=2e-2), (y.float() - ref).abs().max()
