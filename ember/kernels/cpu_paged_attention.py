"""Fused paged attention on CPU for a few queries per sequence (decode, speculative verify).

Why a C++ kernel: the torch path (torch_attention.decode_attention) gathers every sequence's
blocks into a padded [B, L] batch, widens it to float32 and calls SDPA, whose CPU kernel runs
one tiny GEMM per (sequence, kv head). On 2 Zen4 cores, 64 sequences of 128-640 tokens, the
default model's 9/3 heads: ~6 ms per layer, 190 of a 245 ms decode step, moving ~100 MB per
layer for 16 MB of K/V. This kernel reads each K/V row once, straight from its block, in the
cache's dtype (bf16, fp16, fp32, fp8), and keeps a running max and sum per query head. A task is
one query over all its kv heads (a slot's heads are side by side, so the cache is read front to
back), prefetching the next tile's rows as it goes; bf16 queries over a bf16 cache score with
bf16 dot-product instructions (exact products, float32 sums), other dtypes in float32. That is
the AVX-512 build. On CPUs with AVX2 and FMA but no AVX-512 (Zen3) the same tasks run one kv
head at a time with 8-lane FMA loops over rows read in place and a vector exp (200 keys, the
default model's heads, 2 Zen3 threads: 33 -> 14 us a layer against the portable loops, which
copied every row and reduced each dot product in one dependent chain); fp8 caches and CPUs
without AVX2 take the portable loops. Either build splits each context over the
threads when there are fewer queries than twice the threads (batch-1 decode): a batch-1 step
on Zen3 had 3 tasks (one per kv head) for 2 threads before.

Built with torch.utils.cpp_extension (g++ and ninja) when ember is installed (ember.kernels.cpp_build;
~45 s on 2 cores: two translation units side by side, bf16/fp16 and float32/fp8 caches), and
loaded when a CPU engine starts. Where it cannot be built, a warning
says why and the torch path runs; --no-cpu-paged-attention turns it off. It is a dispatcher op
(torch.ops.ember_cpu.paged_attention) with a fake kernel, so compiled decode graphs call it too.
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build

HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # compiled specializations (the switch in the .cpp)
MAX_GROUP = 16  # query heads per kv head (kMaxG)
SOURCE = "cpu_paged_attention.cpp"  # with cpu_paged_attention_fp32_fp8.cpp (float32 / fp8 caches): cpp_build.KERNELS
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2)


# the shapes torch.compile traces the op with
FAKES = {
    "ember_cpu::paged_attention": lambda q, kv_cache, block_tables, seq_idx, kv_lens, scale: torch.empty_like(
        q, dtype=torch.float32
    )
}


def paged_attention_op():
    """The op, or None where it cannot be built (loaded on the first call, logged once if it has to
    be built). Cheap after that: supports() asks it on every attention call."""
    built = build(SOURCE, fakes=FAKES)
    return torch.ops.ember_cpu.paged_attention if built else None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Shapes and dtypes the compiled kernel takes (else the caller uses the torch path)."""
    D, Hq, Hkv = q.shape[-1], q.shape[-2], kv_cache.shape[-2]
    return (
        q.device.type == "cpu"
        and D in HEAD_SIZES
        and Hq % Hkv == 0
        and Hq // Hkv <= MAX_GROUP
        and kv_cache.dtype in CACHE_DTYPES
        and kv_cache.is_contiguous()
        and paged_attention_op() is not None
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    kv_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D]; query i attends to keys 0..kv_lens[i]-1 of sequence seq_idx[i] (its row of
    block_tables). Returns [T, Hq, D] in q's dtype. Call only when paged_attention_op() is not None."""
    # bf16 q over a bf16 cache goes as it is (the kernel's bf16 dot products), else as float32
    qk = q if q.dtype == torch.bfloat16 and kv_cache.dtype == torch.bfloat16 else q.float()
    # supports() checked kv_cache is contiguous; the metadata's tables are int32 already (no copies)
    out = torch.ops.ember_cpu.paged_attention(
        qk.contiguous(),
        kv_cache,
        block_tables.to(torch.int32).contiguous(),
        seq_idx.to(torch.int32),
        kv_lens.to(torch.int32),
        scale,
    )
    return out.to(q.dtype)
