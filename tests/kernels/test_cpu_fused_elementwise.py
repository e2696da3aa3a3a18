"""The fused bf16 RMSNorm (+ residual) and SiLU*up CPU kernels (ember/kernels/cpu_fused_elementwise.*)
against the eager torch ops they replace: the same roundings op for op, so outputs equal on random
rows (row lengths with a vector tail, strided rows, large magnitudes where exp overflows) but for
rare 1-ulp bf16 differences (the norm's float32 sum order, the exp polynomial), and the layers
pick them only where they apply."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_fused_elementwise as fused
from ember.kernels.cpp_build import has_cpu_flags
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers import activation
from ember.layers.norm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm

# This project's machines (and CI's) are Zen4 with AVX-512; elsewhere the torch ops run.
pytestmark = pytest.mark.skipif(not has_cpu_flags("avx512f", "avx512bw"), reason="the fused kernels need AVX-512")


def assert_bf16_equal_but_rare_ulps(got: torch.Tensor, want: torch.Tensor, max_share: float = 0.01, atol: float = 0.0):
    assert got.shape == want.shape and got.dtype == want.dtype == torch.bfloat16
    g, w = got.float(), want.float()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-126))) - 7)  # bf16 keeps 8 significant bits
    ulp = ulp.clamp_min(atol)
    assert bool(((g - w).abs() <= ulp).all()), "a difference of more than one bf16 ulp"
    assert (got != want).float().mean().item() <= max_share


def rows(T, H, seed, scale=1.0, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H + stride_pad, generator=g) * scale).to(torch.bfloat16)
    return x[:, :H]  # stride_pad > 0: rows with a gap between them, as a slice of a wider tensor


@pytest.mark.parametrize("T,H", [(1, 576), (7, 64), (300, 100), (33, 1)])
@pytest.mark.parametrize("stride_pad", [0, 24])
def test_rms_norm_with_and_without_residual_equals_torch_bitwise(T, H, stride_pad):
    assert fused.available()
    norm, ref = RMSNorm(H, 1e-5, torch.bfloat16), RMSNorm(H, 1e-5, torch.bfloat16, kernels=CpuKernels.none())
    norm.weight.data = ref.weight.data = rows(1, H, 9, 2.0)[0].contiguous()
    x, r = rows(T, H, 1, 3.0, stride_pad), rows(T, H, 2).contiguous()
    assert fused.applies(x)
    want_out, want_sum = ref(x, r)
    got_out, got_sum = norm(x, r)
    assert torch.equal(got_sum, want_sum)  # the residual add rounds once either way: exact
    assert_bf16_equal_but_rare_ulps(got_out, want_out)
    assert_bf16_equal_but_rare_ulps(norm(x), ref(x))


@pytest.mark.parametrize("T,H", [(1, 1024), (300, 100), (33, 1)])
@pytest.mark.parametrize("stride_pad", [0, 24])
def test_zero_centered_rms_norm_equals_torch(T, H, stride_pad):
    """Qwen3-Next / Qwen3.5's norm: the weight stored as w - 1, multiplied as (1 + w) in float32."""
    norm = ZeroCenteredRMSNorm(H, 1e-6, torch.bfloat16)
    ref = ZeroCenteredRMSNorm(H, 1e-6, torch.bfloat16, kernels=CpuKernels.none())
    norm.weight.data = ref.weight.data = rows(1, H, 9, 0.5)[0].contiguous()
    x, r = rows(T, H, 1, 3.0, stride_pad), rows(T, H, 2).contiguous()
    calls = []
    real = fused.rms_norm
    try:
        fused.rms_norm = lambda *a, **k: calls.append(k) or real(*a, **k)
        got_out, got_sum = norm(x, r)
        got_plain = norm(x)
    finally:
        fused.rms_norm = real
    assert calls == [{"zero_centered": True}] * 2
    want_out, want_sum = ref(x, r)
    assert torch.equal(got_sum, want_sum)
    assert_bf16_equal_but_rare_ulps(got_out, want_out)
    assert_bf16_equal_but_rare_ulps(got_plain, ref(x))


@pytest.mark.parametrize("T,H,D", [(1, 16, 128), (37, 4, 10), (300, 2, 24)])
def test_gated_rms_norm_equals_torch(T, H, D):
    """Gated DeltaNet's output norm per head, with z a strided view of the qkvz projection (as the
    layer has it) and gates large enough that exp overflows on both sides."""
    norm = GatedRMSNorm(D, 1e-6, torch.bfloat16)
    ref = GatedRMSNorm(D, 1e-6, torch.bfloat16, kernels=CpuKernels.none())
    norm.weight.data = ref.weight.data = rows(1, D, 9, 1.0)[0].contiguous()
    o = rows(T, H * D, 1, 3.0).contiguous().view(T, H, D)
    z = rows(T, H * D, 2, 30.0, stride_pad=40).view(T, H, D)  # rows of a wider projection
    z[0, 0, :2] = torch.tensor([120.0, -120.0])
    assert fused.applies_gated(o, z) and (T == 1 or z.stride(0) == H * D + 40)
    got, want = norm(o, z), ref(o, z)
    assert got.shape == (T, H, D)
    # a gate below -87 gives silu(z) under 1e-36, where the kernel's exp clamps its argument (exp_ps)
    assert_bf16_equal_but_rare_ulps(got, want, atol=1e-36)
    assert not fused.applies_gated(o.float(), z.float()) and not fused.applies_gated(o.transpose(0, 1), z)


@pytest.mark.parametrize("T,I", [(1, 1536), (5, 20), (64, 48)])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_silu_and_mul_equals_torch_bitwise(T, I, scale):
    x = rows(T, 2 * I, 3, scale)
    x[0, :4] = torch.tensor([0.0, -0.0, 120.0, -120.0])  # exp far past its clamp on both sides
    want = activation.silu_and_mul(x, use_kernel=False)
    got = activation.silu_and_mul(x)
    assert got.shape == (T, I)
    assert_bf16_equal_but_rare_ulps(got, want)
    assert torch.equal(got[0, :4], want[0, :4])  # silu(0) = 0, silu(120) = 120 * up, silu(-120) = -0


def test_applies_only_to_bf16_rows_on_cpu_outside_compile(monkeypatch):
    x = rows(4, 64, 0)
    assert fused.applies(x)
    assert not fused.applies(x.float())  # float32 keeps the reference ops
    assert not fused.applies(x.view(4, 4, 16))  # per-head norms (Qwen3's q/k norm) stay torch
    assert not fused.applies(x.t())  # column-major rows
    # a layer built without the kernel (--no-cpu-fused-elementwise) never calls it
    calls = []
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1))
    monkeypatch.setattr(fused, "silu_and_mul", lambda *a: calls.append(1))
    RMSNorm(64, 1e-5, torch.bfloat16, kernels=CpuKernels.none())(x)
    activation.SiluAndMul(CpuKernels.none())(x)
    assert not calls
    RMSNorm(64, 1e-5, torch.bfloat16)(x)
    assert calls == [1]


def test_compiled_norm_traces_the_torch_ops():
    """Inside torch.compile the layers use the torch ops (inductor fuses them itself); outputs agree."""
    norm = RMSNorm(64, 1e-5, torch.bfloat16)
    x, r = rows(8, 64, 4), rows(8, 64, 5).contiguous()
    calls = []
    real = fused.rms_norm
    try:
        fused.rms_norm = lambda *a: calls.append(1) or real(*a)
        out, total = torch.compile(norm, backend="eager")(x, r)
    finally:
        fused.rms_norm = real
    assert not calls
    want_out, want_sum = norm(x, r)
    assert torch.equal(out, want_out) and torch.equal(total, want_sum)


@pytest.mark.parametrize(
    "T,H,D,rot", [(1, 9, 64, 64), (300, 3, 64, 64), (5, 2, 128, 64), (17, 4, 16, 16), (3, 1, 80, 40)]
)
def test_rotary_equals_torch_bitwise(T, H, D, rot):
    """q / k as strided views of a fused qkv row, partial rotary (rot < D: the rest passed through),
    half widths with a vector tail (8, 20): bit-equal to apply_rotary's bf16 ops."""
    from ember.layers.rotary import apply_rotary

    assert fused.available()
    g = torch.Generator().manual_seed(T * D + rot)
    qkv = (torch.randn(T, H + 2, D, generator=g) * 3).to(torch.bfloat16)
    x = qkv[:, :H]
    angles = torch.rand(T, rot // 2, generator=g) * 100
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    assert fused.applies_rotary(x, cos) and not fused.applies_rotary(x.float(), cos.float())
    got = apply_rotary(x, cos, sin)
    want = apply_rotary(x, cos, sin, use_kernel=False)
    assert got.shape == want.shape == (T, H, D) and got.dtype == torch.bfloat16
    assert torch.equal(got, want)
