"""The fused RMSNorm (+ residual), gated norm, SiLU*up and rotary CPU kernels
(ember/kernels/cpu_fused_elementwise.*) against the eager torch ops they replace, in bf16 and float32:
the same roundings op for op, so outputs equal on random rows (row lengths with a vector tail of 16
and of 8 lanes, strided rows as the layers pass them, large magnitudes where exp overflows) but for
rare ulp differences (the norm's float32 sum order, the exp polynomial); the layers pick them only
where they apply; and the AVX2 build (-march=haswell) run through this module on an AVX-512 machine."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_fused_elementwise as fused
from ember.kernels.cpp_build import has_cpu_flags
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers import activation
from ember.layers.norm import GatedRMSNorm, RMSNorm, ZeroCenteredRMSNorm
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(
    not (has_cpu_flags("avx512f", "avx512bw") or has_cpu_flags("avx2", "fma")),
    reason="the fused kernels need AVX-512 (F, BW) or AVX2 + FMA",
)
DTYPES = [torch.bfloat16, torch.float32]


def assert_equal_but_rare_ulps(
    got: torch.Tensor, want: torch.Tensor, ulps: int = 1, max_share: float = 0.01, atol: float = 0.0
):
    """Every element within `ulps` ulps of the eager op's (of its dtype: 8 significant bits for bf16,
    24 for float32), at most max_share of them different at all."""
    assert got.shape == want.shape and got.dtype == want.dtype
    bits = 8 if want.dtype == torch.bfloat16 else 24
    g, w = got.float(), want.float()
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-126))) - (bits - 1)).clamp_min(atol)
    worst = ((g - w).abs() / ulp).max().item()
    assert worst <= ulps, f"a difference of {worst:.1f} ulps"
    assert (got != want).float().mean().item() <= max_share


def rows(T, H, seed, scale=1.0, stride_pad=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, H + stride_pad, generator=g) * scale).to(dtype)
    return x[:, :H]  # stride_pad > 0: rows with a gap between them, as a slice of a wider tensor


def counted(monkeypatch, name: str) -> list:
    """Calls of fused.<name> (the layer took the kernel), each as its keyword arguments."""
    calls, real = [], getattr(fused, name)
    monkeypatch.setattr(fused, name, lambda *a, **k: calls.append(k) or real(*a, **k))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 576), (7, 64), (300, 100), (5, 1027), (33, 1)])
@pytest.mark.parametrize("stride_pad", [0, 24])
def test_rms_norm_with_and_without_residual_equals_torch(T, H, stride_pad, dtype, monkeypatch):
    norm, ref = RMSNorm(H, 1e-5, dtype), RMSNorm(H, 1e-5, dtype, kernels=CpuKernels.none())
    norm.weight.data = ref.weight.data = rows(1, H, 9, 2.0, dtype=dtype)[0].contiguous()
    x, r = rows(T, H, 1, 3.0, stride_pad, dtype), rows(T, H, 2, dtype=dtype).contiguous()
    assert fused.applies(x)
    calls = counted(monkeypatch, "rms_norm")
    want_out, want_sum = ref(x, r)
    got_out, got_sum = norm(x, r)
    assert torch.equal(got_sum, want_sum)  # the residual add rounds once either way: exact
    # float32: the norm's sum order and 1 / sqrt against torch's (each a few ulps from the float64 norm);
    # a row's 1 / rms an ulp apart moves most of its elements, so no bound on how many differ
    ulps, share = (1, 0.01) if dtype == torch.bfloat16 else (8, 1.0)
    assert_equal_but_rare_ulps(got_out, want_out, ulps, share)
    assert_equal_but_rare_ulps(norm(x), ref(x), ulps, share)
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 1024), (300, 100), (33, 1), (3, 9)])
@pytest.mark.parametrize("stride_pad", [0, 24])
def test_zero_centered_rms_norm_equals_torch(T, H, stride_pad, dtype, monkeypatch):
    """Qwen3-Next / Qwen3.5's norm: the weight stored as w - 1, multiplied as (1 + w) in float32."""
    norm = ZeroCenteredRMSNorm(H, 1e-6, dtype)
    ref = ZeroCenteredRMSNorm(H, 1e-6, dtype, kernels=CpuKernels.none())
    norm.weight.data = ref.weight.data = rows(1, H, 9, 0.5, dtype=dtype)[0].contiguous()
    x, r = rows(T, H, 1, 3.0, stride_pad, dtype), rows(T, H, 2, dtype=dtype).contiguous()
    calls = counted(monkeypatch, "rms_norm")
    got_out, got_sum = norm(x, r)
    got_plain = norm(x)
    assert calls == [{"zero_centered": True}] * 2
    want_out, want_sum = ref(x, r)
    assert torch.equal(got_sum, want_sum)
    ulps, share = (1, 0.01) if dtype == torch.bfloat16 else (8, 1.0)
    assert_equal_but_rare_ulps(got_out, want_out, ulps, share)
    assert_equal_but_rare_ulps(got_plain, ref(x), ulps, share)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,D", [(1, 16, 128), (37, 4, 10), (300, 2, 24), (3, 3, 13)])
def test_gated_rms_norm_equals_torch(T, H, D, dtype, monkeypatch):
    """Gated DeltaNet's output norm per head, with z a strided view of the qkvz projection (as the
    layer has it) and gates large enough that exp overflows on both sides."""
    norm = GatedRMSNorm(D, 1e-6, dtype)
    ref = GatedRMSNorm(D, 1e-6, dtype, kernels=CpuKernels.none())
    norm.weight.data = ref.weight.data = rows(1, D, 9, 1.0, dtype=dtype)[0].contiguous()
    o = rows(T, H * D, 1, 3.0, dtype=dtype).contiguous().view(T, H, D)
    z = rows(T, H * D, 2, 30.0, stride_pad=40, dtype=dtype).view(T, H, D)  # rows of a wider projection
    z[0, 0, :2] = torch.tensor([120.0, -120.0])
    assert fused.applies_gated(o, z) and (T == 1 or z.stride(0) == H * D + 40)
    calls = counted(monkeypatch, "gated_rms_norm")
    got, want = norm(o, z), ref(o, z)
    assert got.shape == (T, H, D) and len(calls) == 1
    # a gate below -87 gives silu(z) under 1e-36, where the kernel's exp clamps its argument (vexp)
    ulps, share = (1, 0.01) if dtype == torch.bfloat16 else (8, 1.0)
    assert_equal_but_rare_ulps(got, want, ulps, share, atol=1e-36)
    assert not fused.applies_gated(o.double(), z.double()) and not fused.applies_gated(o.transpose(0, 1), z)
    assert not fused.applies_gated(o, z.float() if dtype == torch.bfloat16 else z.bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 1536), (5, 20), (64, 48), (3, 7)])
@pytest.mark.parametrize("scale", [1.0, 30.0])
def test_silu_and_mul_equals_torch(T, I, scale, dtype, monkeypatch):
    x = rows(T, 2 * I, 3, scale, dtype=dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 120.0, -120.0])  # exp far past its clamp on both sides
    want = activation.silu_and_mul(x, use_kernel=False)
    calls = counted(monkeypatch, "silu_and_mul")
    got = activation.silu_and_mul(x)
    assert got.shape == (T, I) and len(calls) == 1
    # float32: the exp polynomial (2 ulp) against torch's, then the division and the product
    ulps, share = (1, 0.01) if dtype == torch.bfloat16 else (6, 1.0)
    assert_equal_but_rare_ulps(got, want, ulps, share)
    assert torch.equal(got[0, :4], want[0, :4])  # silu(0) = 0, silu(120) = 120 * up, silu(-120) = -0


def test_applies_only_to_bf16_and_float32_rows_on_cpu_outside_compile(monkeypatch):
    x = rows(4, 64, 0)
    assert fused.applies(x) and fused.applies(x.float())
    assert not fused.applies(x.half()) and not fused.applies(x.double())  # these keep the reference ops
    assert not fused.applies(x.view(4, 4, 16))  # per-head norms (Qwen3's q/k norm) stay torch
    assert not fused.applies(x.t())  # column-major rows
    # a layer built without the kernel (--no-cpu-fused-elementwise) never calls it
    calls = []
    monkeypatch.setattr(fused, "rms_norm", lambda *a: calls.append(1))
    monkeypatch.setattr(fused, "silu_and_mul", lambda *a: calls.append(1))
    RMSNorm(64, 1e-5, torch.bfloat16, kernels=CpuKernels.none())(x)
    activation.SiluAndMul(CpuKernels.none())(x)
    RMSNorm(64, 1e-5, torch.float32)(x)  # a weight of another dtype than x's: the torch ops
    assert not calls
    RMSNorm(64, 1e-5, torch.bfloat16)(x)
    RMSNorm(64, 1e-5, torch.float32)(x.float())
    assert calls == [1, 1]


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "T,H,D,rot", [(1, 9, 64, 64), (300, 3, 64, 64), (5, 2, 128, 64), (17, 4, 16, 16), (3, 1, 80, 40), (2, 3, 24, 12)]
)
def test_rotary_equals_torch_bitwise(T, H, D, rot, dtype, monkeypatch):
    """q / k as strided views of a fused qkv row, partial rotary (rot < D: the rest passed through),
    half widths with a vector tail (6, 8, 20): bit-equal to apply_rotary's ops in bf16 and in float32
    (every product rounded: none fused into an FMA)."""
    from ember.layers.rotary import apply_rotary

    g = torch.Generator().manual_seed(T * D + rot)
    qkv = (torch.randn(T, H + 2, D, generator=g) * 3).to(dtype)
    x = qkv[:, :H]
    angles = torch.rand(T, rot // 2, generator=g) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    assert fused.applies_rotary(x, cos) and not fused.applies_rotary(x.double(), cos.double())
    assert not fused.applies_rotary(x, cos.half())  # cos / sin in another dtype than x's: the torch ops
    calls = counted(monkeypatch, "rotary")
    got = apply_rotary(x, cos, sin)
    want = apply_rotary(x, cos, sin, use_kernel=False)
    assert got.shape == want.shape == (T, H, D) and got.dtype == dtype and len(calls) == 1
    assert torch.equal(got, want)


def test_bad_input_is_refused():
    x = rows(2, 8, 0)
    with pytest.raises(RuntimeError, match="x's dtype"):
        torch.ops.ember_cpu.rms_norm(x, None, torch.ones(8), 1e-6, False)  # a float32 weight for bf16 rows
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        torch.ops.ember_cpu.silu_and_mul(x.half())
    with pytest.raises(RuntimeError, match="residual must match"):
        torch.ops.ember_cpu.rms_norm(x, rows(3, 8, 1).contiguous(), torch.ones(8, dtype=torch.bfloat16), 1e-6, False)


def test_the_build_is_this_cpus():
    """16 lanes where the CPU has AVX-512 (F, BW), else the AVX2 build's 8 (in the AVX2 child run below too)."""
    assert fused.available()
    assert fused.lanes() == (16 if has_cpu_flags("avx512f", "avx512bw") else 8)


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine's build is the 16-lane AVX-512 one, the 8-lane AVX2 + FMA build (Zen2/3,
    Haswell on) is compiled here with -march=haswell under the name this machine looks for, in a kernel
    dir of its own, and this module's other tests run against it in a child process that reads the CPU
    flags as such a machine's (tests/kernels/haswell_flags.py)."""
    if not has_cpu_flags("avx512f", "avx512bw"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build(fused.SOURCE)
    probe = "from ember.kernels import cpu_fused_elementwise as f; print(f.available(), f.lanes())"
    said, run = avx2_child.probe_and_run(env, probe, __file__)
    assert said == ["True", "8"]
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-2000:]
