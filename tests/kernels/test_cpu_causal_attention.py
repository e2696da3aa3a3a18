"""The C++ causal (prefill) attention kernel (ember/kernels/cpu_causal_attention.*) alone against
float64 attention: its bf16 form (AVX512-BF16) and its float32 form (float32 queries over float32 or
bf16 keys and values; AVX-512 or AVX2 + FMA), which of it and the GEMM path runs, and the AVX2 build
(-march=haswell) run through this module on an AVX-512 machine."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_causal_attention as causal
from ember.kernels.cpp_build import has_cpu_flags
from tests.kernels import avx2_child

# the bf16 kernel is AVX512-BF16 code: this project's Zen4 and Xeon machines run it, its Zen3 ones cannot
needs_avx512_bf16 = pytest.mark.skipif(
    not has_cpu_flags("avx512f", "avx512_bf16"), reason="the C++ bf16 prefill attention kernel needs AVX512-BF16"
)
needs_f32_kernel = pytest.mark.skipif(
    not (has_cpu_flags("avx512f") or has_cpu_flags("avx2", "fma")),
    reason="the C++ float32 prefill attention kernel needs AVX-512 or AVX2 + FMA",
)


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 causal attention of q [n, Hq, D] at positions S-n..S-1 over k / v [S, Hkv, D]."""
    n, S, G = q.shape[0], k.shape[0], q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(G, 1)) * scale
    seen = torch.arange(S)[None, :] <= torch.arange(S - n, S)[:, None]
    p = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", p, v.double().repeat_interleave(G, 1))


@needs_avx512_bf16
@pytest.mark.parametrize(
    "n,S,hq,hkv,d",
    [
        (300, 300, 9, 3, 64),
        (37, 100, 9, 3, 64),
        (1, 1, 2, 1, 32),
        (1, 45, 4, 4, 16),
        (65, 65, 16, 2, 128),
        (50, 83, 28, 4, 128),
        (33, 33, 8, 8, 256),
        (40, 70, 12, 2, 96),
        (20, 20, 15, 3, 80),
        (19, 19, 7, 1, 64),
    ],
)
@pytest.mark.parametrize("peaky", [False, True])
def test_flash_prefill_kernel_matches_reference(n, S, hq, hkv, d, peaky):
    """The bf16 kernel: groups of 1-8 query heads (taken 1-4 at a time), head sizes 16-256, a prompt
    alone and a chunk over a prefix (n < S), lengths ending mid-tile, q a strided view of a fused qkv
    row. peaky: scores in the hundreds (exp underflow)."""
    assert causal.flash_available()
    g = torch.Generator().manual_seed(n * d + hq)
    qkv = (torch.randn(n, hq + 2 * hkv, d, generator=g) * (30.0 if peaky else 2.0)).to(torch.bfloat16)
    q = qkv[:, :hq]
    assert causal.use_flash_attention(q) and q.stride(0) == (hq + 2 * hkv) * d
    k = torch.randn(S, hkv, d, generator=g).to(torch.bfloat16)
    v = torch.randn(S, hkv, d, generator=g).to(torch.bfloat16)
    out = causal.flash_attention(q, k, v, d**-0.5)
    ref = reference(q, k, v, d**-0.5)
    # bf16 output (half an ulp: 2^-9 relative) plus bf16-rounded probabilities in P V
    assert out.dtype == torch.bfloat16 and out.shape == (n, hq, d)
    assert ((out.double() - ref).abs() <= 8e-3 * ref.abs() + 4e-3).all()


@needs_avx512_bf16
def test_flash_prefill_kernel_widens_fp8_keys_and_values():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(40, 6, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(50, 2, 64, generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(50, 2, 64, generator=g).to(torch.float8_e4m3fn)
    out = causal.causal_attention(q, k, v, 0.125)
    assert torch.equal(out, causal.flash_attention(q, k.to(torch.bfloat16), v.to(torch.bfloat16), 0.125))
    ref = causal.causal_attention_gemm(q, k, v, 0.125)
    assert (out.float() - ref.float()).abs().max() < 3e-2


@pytest.mark.parametrize("amx", [True, False])
def test_on_amx_large_prefills_take_the_gemm_path(monkeypatch, amx):
    """Where oneDNN's GEMMs run on AMX the GEMM path serves bf16 at head_dim >= 128 from MIN_QUERIES
    queries and head_dim 64 from 1M query-key pairs (benchmarks/micro_causal_attention.py); elsewhere
    the C++ kernel serves all of them. Either way the answer matches the other path's."""
    if not causal.flash_available():
        pytest.skip("the C++ bf16 kernel needs AVX512-BF16")
    monkeypatch.setattr(causal, "AMX", amx)
    ran = []
    for name in ("flash_attention", "causal_attention_gemm"):
        real = getattr(causal, name)
        monkeypatch.setattr(causal, name, lambda *a, _n=name, _f=real: ran.append(_n) or _f(*a))
    g = torch.Generator().manual_seed(3)
    for n, S, hq, hkv, d, gemm_on_amx in (
        (128, 128, 4, 2, 128, True),
        (200, 200, 4, 1, 256, True),
        (127, 127, 4, 1, 256, False),  # below MIN_QUERIES
        (256, 256, 6, 2, 64, False),  # 64K pairs
        (512, 2048, 3, 1, 64, True),  # 1M pairs
    ):
        q = torch.randn(n, hq, d, generator=g).bfloat16()
        k, v = (torch.randn(S, hkv, d, generator=g).bfloat16() for _ in range(2))
        ran.clear()
        out = causal.causal_attention(q, k, v, d**-0.5)
        assert ran == ["causal_attention_gemm" if amx and gemm_on_amx else "flash_attention"], (n, S, d)
        other = causal.flash_attention(q, k, v, d**-0.5) if ran[0] != "flash_attention" else None
        if other is not None:
            torch.testing.assert_close(out.float(), other.float(), atol=3e-2, rtol=2e-2)


@needs_f32_kernel
def test_f32_kernel_is_this_builds_width():
    """16 float32 lanes where the build has AVX-512, 8 in the AVX2 + FMA one (Zen2/3, Haswell on)."""
    assert causal.flash_available(torch.float32)
    assert torch.ops.ember_cpu.causal_attention_lanes() == (16 if has_cpu_flags("avx512f") else 8)
    assert causal.flash_available(torch.bfloat16) == has_cpu_flags("avx512f", "avx512_bf16")
    assert not causal.flash_available(torch.float16)


@needs_f32_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "n,S,hq,hkv,d",
    [
        (1, 1, 3, 1, 64),  # one query, one key
        (7, 7, 9, 3, 64),  # the default model's heads, under one tile
        (33, 33, 8, 1, 64),  # a group of 8, a tile and a key past it
        (130, 130, 9, 3, 64),  # blocks of 16 queries ending mid-way
        (130, 517, 9, 3, 64),  # a chunk over a cached prefix
        (1, 40, 4, 4, 256),  # group 1: one query over a prefix
        (33, 100, 8, 2, 256),  # Qwen3.5's full-attention heads over a prefix
        (130, 130, 24, 3, 256),  # group 8
        (7, 20, 6, 2, 16),  # the other head sizes, groups of 3 and tails of 1-3 rows
        (9, 9, 4, 4, 32),
        (20, 45, 15, 3, 80),
        (17, 17, 12, 4, 96),
        (33, 70, 16, 2, 128),
    ],
)
@pytest.mark.parametrize("peaky", [False, True])
def test_f32_kernel_matches_reference(n, S, hq, hkv, d, kv_dtype, peaky):
    """The float32 kernel: float32 queries over float32 or bf16 keys and values (bf16 widens exactly,
    so the float64 reference reads the same values), odd lengths, prompts alone and chunks over a
    cached prefix (S > n), GQA groups 1-8, every head size; q a strided view of a fused qkv row.
    Everything is float32, so the output is within float32 rounding of float64 attention. peaky:
    scores in the hundreds (most exp underflow), whose float32 rounding (~1e-5 of a score) moves the
    output up to ~1e-4: SDPA in float32 is off by as much (8.5e-5 at 24 / 3 x 256, 130 queries)."""
    g = torch.Generator().manual_seed(n * d + hq + S)
    qkv = torch.randn(n, hq + 2 * hkv, d, generator=g) * (30.0 if peaky else 2.0)
    q = qkv[:, :hq]
    assert causal.use_flash_attention(q) and q.stride(0) == (hq + 2 * hkv) * d
    k = torch.randn(S, hkv, d, generator=g).to(kv_dtype)
    v = torch.randn(S, hkv, d, generator=g).to(kv_dtype)
    out = causal.flash_attention(q, k, v, d**-0.5)
    assert out.dtype == torch.float32 and out.shape == (n, hq, d)
    tol = 2e-4 if peaky else 2e-5
    torch.testing.assert_close(out.double(), reference(q, k, v, d**-0.5), rtol=tol, atol=tol)


@needs_f32_kernel
def test_f32_kernel_takes_strided_keys_and_widens_fp16_and_fp8():
    """Keys and values as views of a fused row go in as they are; fp16 and fp8 (a cache of either
    under float32 queries) widen to float32 exactly first."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(40, 6, 64, generator=g)
    kv = torch.randn(50, 4, 64, generator=g)
    k, v = kv[:, :2], kv[:, 2:]
    ref = reference(q, k, v, 0.125)
    torch.testing.assert_close(causal.flash_attention(q, k, v, 0.125).double(), ref, rtol=2e-5, atol=2e-5)
    for dtype in (torch.float16, torch.float8_e4m3fn):
        k8, v8 = k.to(dtype), v.to(dtype)
        out = causal.flash_attention(q, k8, v8, 0.125)
        torch.testing.assert_close(out.double(), reference(q, k8.float(), v8.float(), 0.125), rtol=2e-5, atol=2e-5)


@needs_f32_kernel
def test_f32_fake_kernel_gives_the_shape():
    """torch.compile traces the op with its fake kernel: q's shape and dtype, k / v in either dtype."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert causal.flash_available(torch.float32)
    with FakeTensorMode():
        q, k = torch.empty(5, 4, 64), torch.empty(9, 2, 64, dtype=torch.bfloat16)
        out = torch.ops.ember_cpu.causal_attention_f32(q, k, k, 0.125)
    assert out.shape == (5, 4, 64) and out.dtype == torch.float32


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine has AVX-512 the kernel is its AVX-512 build; the AVX2 + FMA build (Zen2/3,
    Haswell on: the float32 kernel on 8 lanes, no bf16 kernel) is compiled here with -march=haswell
    under the name this machine looks for, in a kernel dir of its own, and this module's other tests
    run against it in a child process that reads the CPU flags as such a machine's
    (tests/kernels/haswell_flags.py)."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build("cpu_causal_attention.cpp")
    probe = "import torch; from ember.kernels import cpu_causal_attention as c; "
    probe += (
        "print(c.flash_available(torch.float32), c.flash_available(), torch.ops.ember_cpu.causal_attention_lanes())"
    )
    said, run = avx2_child.probe_and_run(env, probe, __file__)
    assert said == ["True", "False", "8"]
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
