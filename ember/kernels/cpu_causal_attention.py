"""Causal attention for bf16 and float32 queries on CPU (prefill and prefill chunks): a flash-style
C++ kernel, else blocked GEMMs (also where they are the faster: large bf16 shapes on CPUs with AMX).

The C++ kernel (cpu_causal_attention.cpp) has two forms of one structure: scores, online softmax and
P V per key tile, nothing of size queries x keys in memory, one call per sequence and layer.
- bf16 queries (needs AVX512-BF16): bf16 dot-product instructions; ~2.4x the GEMM path below on a
  prefill chunk on Zen4 (docs/tuning.md, CPU kernels), slower than it on large shapes where oneDNN's
  GEMMs run on AMX (below). Numerics: float32 scores from exact bf16 products, float32 softmax, the
  probabilities rounded to bf16 for P V (as the GEMM path's bf16 softmax output), float32
  accumulation; max error against float64 attention ~half a bf16 ulp of the output.
- float32 queries over float32 or bf16 k/v (AVX2 + FMA: Zen2/3, Intel's desktop chips, where
  --dtype auto is float32; 16 lanes where the build has AVX-512): FMA dot products, everything in
  float32 (bf16 k/v widen exactly), float32 out; error against float64 attention ~1e-6.

The GEMM path (the fallback, and for fp16): torch's CPU flash kernel (SDPA) reaches a fraction of
what oneDNN's plain bf16 GEMM does at head_dim 64 in bf16 (docs/tuning.md). So for each block of BLOCK_QUERIES queries and each kv head: scores = Q_blk
K[:end]^T (one GEMM, the G query heads of the kv head stacked as rows, so K/V are never
repeated for GQA), a causal mask on the diagonal block only, softmax, then P V[:end] (one GEMM).
Blocks skip the keys after their last query, so the causal half is never computed. Its numerics
are those of eager bf16 attention (HF's "eager" path): scores rounded to bf16 after an
fp32-accumulated GEMM, softmax computed in fp32 inside torch's bf16 kernel. Relative error
against fp32 attention ~4e-3 (SDPA bf16: ~2e-3).
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build
from ember.platform import cpu_has_amx, has_cpu_flags

MIN_QUERIES = 128  # below this SDPA is as fast and the per-block calls dominate

# On CPUs with AMX (Intel Sapphire Rapids on), oneDNN runs bf16 GEMMs on the tile unit, and the GEMM
# path beats the C++ kernel (AVX512-BF16 dot products) at head_dim >= 128 from MIN_QUERIES queries
# (2.4-4x at head_dim 256 from 512 queries) and at head_dim 64 from about 1M query-key pairs (1.4x at
# 512 queries over 2,048 keys; the kernel stays ahead below: 0.58 vs 1.1 ms at 128 x 128). Blocks of
# 256 queries beat 128 there at every shape measured (benchmarks/micro_causal_attention.py, docs/tuning.md).
AMX = cpu_has_amx()  # read once: a compiled step cannot trace the flags lookup
AMX_GEMM_MIN_HEAD_DIM = 128
AMX_GEMM_MIN_PAIRS = 1 << 20
# queries per block of the GEMM path (docs/tuning.md: without AMX 64..256 are close and 128 best)
BLOCK_QUERIES = 256 if AMX else 128


HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # the C++ kernel's compiled head sizes (its switch)
BF16_KERNEL = has_cpu_flags("avx512f", "avx512_bf16")  # the build has the bf16 kernel (read once, as AMX)
# both ops are defined in every build; the bf16 one runs only where the build has AVX512-BF16
FAKES = {
    "ember_cpu::causal_attention_bf16": lambda q, k, v, scale: q.new_empty(q.shape),
    "ember_cpu::causal_attention_f32": lambda q, k, v, scale: q.new_empty(q.shape),
}


def flash_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """The C++ kernel for `dtype` queries can run here (loaded, built once first where it was not built
    at install): bf16 needs AVX512-BF16, float32 AVX2 + FMA (or AVX-512); other dtypes have none."""
    if dtype == torch.bfloat16 and not BF16_KERNEL:
        return False
    return dtype in (torch.bfloat16, torch.float32) and build("cpu_causal_attention.cpp", fakes=FAKES) is not None


def use_flash_attention(q: torch.Tensor) -> bool:
    """bf16 or float32 queries on CPU with a compiled head size, rows of [Hq, D] (strided rows are fine)."""
    return (
        q.device.type == "cpu"
        and q.dim() == 3
        and q.shape[-1] in HEAD_SIZES
        and q.stride(-1) == 1
        and q.stride(1) == q.shape[-1]
        and flash_available(q.dtype)
    )


def attention_path(q: torch.Tensor, num_keys: int, flash: bool = True) -> str | None:
    """Which path causal_attention takes for q over num_keys keys: "flash" (the C++ kernel where it
    applies and `flash`, the backend's --cpu-flash-attention, unless the GEMM path beats it on this
    machine), "gemm" where that pays off, else None (the caller's SDPA).

    float32 queries take the kernel at every length, keyed on q.dtype and the build alone (no AMX or
    length rule): built -march=haswell on an AVX-512 Xeon held to AVX2 (oneDNN, MKL, ATen), 2 threads,
    it beat SDPA 1.1-1.8x from 16 to 2,000 queries (at par at 3-4K) and float32 GEMMs 1.2-5x; the
    AVX-512 build likewise, at par with SDPA at 2-3K queries x 256 (benchmarks/micro_causal_attention.py
    float32, docs/tuning.md). With the kernel off, float32 keeps SDPA."""
    # the kernel has no backward: a forward autograd records (MTP training) keeps the differentiable paths
    differentiable = torch.is_grad_enabled() and q.requires_grad
    if flash and use_flash_attention(q) and not amx_gemm_beats_flash(q, num_keys) and not differentiable:
        return "flash"
    if use_gemm_attention(q):
        return "gemm"
    return None


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flash: bool = True
) -> torch.Tensor | None:
    """q [n, Hq, D] at positions S-n..S-1 over k/v [S, Hkv, D] by attention_path: [n, Hq, D] in q's
    dtype, or None (the caller's SDPA)."""
    path = attention_path(q, k.shape[0], flash)
    if path == "flash":
        return flash_attention(q, k, v, scale)
    if path == "gemm":
        return causal_attention_gemm(q, k, v, scale)
    return None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The C++ kernel; call where use_flash_attention(q). Returns [n, Hq, D] in q's dtype."""
    if q.dtype == torch.float32:
        # bf16 k/v (a bf16 cache under float32 queries) go in as they are, widened in the kernel; fp16
        # and fp8 widen to float32 here, exactly
        kv_dtype = k.dtype if k.dtype in (torch.float32, torch.bfloat16) else torch.float32
        op = torch.ops.ember_cpu.causal_attention_f32
    else:
        kv_dtype = torch.bfloat16  # fp8 k/v (an fp8 cache) widen exactly
        op = torch.ops.ember_cpu.causal_attention_bf16
    # the kernel takes k and v as rows of [Hkv, D] with one stride
    k, v = k.to(kv_dtype), v.to(kv_dtype)
    D = q.shape[-1]
    if k.stride(2) != 1 or k.stride(1) != D or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    return op(q, k, v, scale)


def amx_gemm_beats_flash(q: torch.Tensor, num_keys: int) -> bool:
    """Where the GEMM path is the faster of the two on this machine (AMX above; bf16 only): at head_dim
    >= AMX_GEMM_MIN_HEAD_DIM, or from AMX_GEMM_MIN_PAIRS queries x keys."""
    n, D = q.shape[0], q.shape[-1]
    return (
        AMX
        and q.dtype == torch.bfloat16
        and n >= MIN_QUERIES
        and (D >= AMX_GEMM_MIN_HEAD_DIM or n * num_keys >= AMX_GEMM_MIN_PAIRS)
    )


def use_gemm_attention(q: torch.Tensor) -> bool:
    """The GEMM path pays off for bf16 on CPU at >= MIN_QUERIES queries; float32 GEMMs are slower than
    SDPA (1.0-3.5x its time at 16-2,000 queries, AVX2; benchmarks/micro_causal_attention.py float32),
    fp16 GEMMs have no fast CPU kernel here."""
    return q.device.type == "cpu" and q.dtype == torch.bfloat16 and q.shape[0] >= MIN_QUERIES


def causal_attention_gemm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions S-n..S-1 over k/v [S, Hkv, D] (positions 0..S-1): query i sees
    keys <= S - n + i. Returns [n, Hq, D] in q's dtype."""
    n, Hq, D = q.shape
    S, Hkv = k.shape[0], k.shape[1]
    G = Hq // Hkv
    ctx = S - n
    # Rows ordered (position, head-in-group) per kv head; the softmax scale folded into q.
    qs = (q * scale).view(n, Hkv, G, D).transpose(0, 1).reshape(Hkv, n * G, D)
    kh = k.to(q.dtype).transpose(0, 1).contiguous()  # [Hkv, S, D]; fp8 k widens exactly
    vh = v.to(q.dtype).transpose(0, 1).contiguous()
    out = torch.empty(Hkv, n * G, D, dtype=q.dtype, device=q.device)
    B = min(BLOCK_QUERIES, n)
    # Additive mask of the diagonal block: row (i, g) sees columns <= i.
    diag = torch.full((B, B), float("-inf"), dtype=q.dtype, device=q.device).triu_(1).repeat_interleave(G, 0)
    for s0 in range(0, n, B):
        m = min(n, s0 + B) - s0
        end = ctx + s0 + m  # keys this block can see
        rows = slice(s0 * G, (s0 + m) * G)
        for h in range(Hkv):
            scores = torch.mm(qs[h, rows], kh[h, :end].t())  # [m*G, end]
            scores[:, end - m :].add_(diag[: m * G, :m])
            torch.mm(torch.softmax(scores, -1), vh[h, :end], out=out[h, rows])
    return out.view(Hkv, n, G, D).transpose(0, 1).reshape(n, Hq, D)
