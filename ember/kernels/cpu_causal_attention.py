"""Causal attention for bf16 queries on CPU (prefill and prefill chunks): a flash-style C++
kernel, else blocked GEMMs (also where they are the faster: large shapes on CPUs with AMX).

The C++ kernel (cpu_causal_attention.cpp, needs AVX512-BF16): scores, online softmax and P V
per 32-key tile with bf16 dot-product instructions, nothing of size queries x keys in memory,
one call per sequence and layer; ~2.4x the GEMM path below on a prefill chunk on Zen4 (docs/tuning.md,
CPU kernels), slower than it on large shapes where oneDNN's GEMMs run on AMX (below). Numerics: float32 scores from exact bf16 products, float32 softmax, the
probabilities rounded to bf16 for P V (as the GEMM path's bf16 softmax output), float32
accumulation; max error against float64 attention ~half a bf16 ulp of the output.

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
from ember.platform import has_cpu_flags

MIN_QUERIES = 128  # below this SDPA is as fast and the per-block calls dominate

# On CPUs with AMX (Intel Sapphire Rapids on), oneDNN runs bf16 GEMMs on the tile unit, and the GEMM
# path beats the C++ kernel (AVX512-BF16 dot products) at head_dim >= 128 from MIN_QUERIES queries
# (2.4-4x at head_dim 256 from 512 queries) and at head_dim 64 from about 1M query-key pairs (1.4x at
# 512 queries over 2,048 keys; the kernel stays ahead below: 0.58 vs 1.1 ms at 128 x 128). Blocks of
# 256 queries beat 128 there at every shape measured (benchmarks/micro_causal_attention.py, docs/tuning.md).
AMX = has_cpu_flags("amx_bf16", "amx_tile")  # read once: a compiled step cannot trace the flags lookup
AMX_GEMM_MIN_HEAD_DIM = 128
AMX_GEMM_MIN_PAIRS = 1 << 20
# queries per block of the GEMM path (docs/tuning.md: without AMX 64..256 are close and 128 best)
BLOCK_QUERIES = 256 if AMX else 128


HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # the C++ kernel's compiled head sizes (its switch)
FAKES = {"ember_cpu::causal_attention_bf16": lambda q, k, v, scale: q.new_empty(q.shape)}


def flash_available() -> bool:
    """The C++ kernel can run here (AVX512-BF16; loaded, built once first where it was not built at
    install)."""
    return build("cpu_causal_attention.cpp", fakes=FAKES) is not None


def use_flash_attention(q: torch.Tensor) -> bool:
    """bf16 queries on CPU with a compiled head size, rows of [Hq, D] (strided rows are fine)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and q.dim() == 3
        and q.shape[-1] in HEAD_SIZES
        and q.stride(-1) == 1
        and q.stride(1) == q.shape[-1]
        and flash_available()
    )


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, flash: bool = True
) -> torch.Tensor | None:
    """q [n, Hq, D] at positions S-n..S-1 over k/v [S, Hkv, D]: the C++ kernel where it applies (and
    `flash`, the backend's --cpu-flash-attention) unless the GEMM path beats it on this machine, else
    the GEMM path where it pays off, else None (the caller's SDPA)."""
    if flash and use_flash_attention(q) and not amx_gemm_beats_flash(q, k.shape[0]):
        return flash_attention(q, k, v, scale)
    if use_gemm_attention(q):
        return causal_attention_gemm(q, k, v, scale)
    return None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The C++ kernel; call where use_flash_attention(q). Returns [n, Hq, D] bf16."""
    # fp8 k/v (an fp8 cache) widen exactly; the kernel takes k and v as rows of [Hkv, D] with one stride
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    D = q.shape[-1]
    if k.stride(2) != 1 or k.stride(1) != D or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    return torch.ops.ember_cpu.causal_attention_bf16(q, k, v, scale)


def amx_gemm_beats_flash(q: torch.Tensor, num_keys: int) -> bool:
    """Where the GEMM path is the faster of the two on this machine (AMX above): at head_dim >=
    AMX_GEMM_MIN_HEAD_DIM, or from AMX_GEMM_MIN_PAIRS queries x keys."""
    n, D = q.shape[0], q.shape[-1]
    return AMX and n >= MIN_QUERIES and (D >= AMX_GEMM_MIN_HEAD_DIM or n * num_keys >= AMX_GEMM_MIN_PAIRS)


def use_gemm_attention(q: torch.Tensor) -> bool:
    """The GEMM path pays off for bf16 on CPU at >= MIN_QUERIES queries; fp32 keeps SDPA (the
    reference numerics), fp16 GEMMs have no fast CPU kernel here."""
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
