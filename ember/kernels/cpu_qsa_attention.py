"""QSA selected-block attention on CPU (qwen4_exp's sparse attention layers, ember/layers/qsa.py).

Contract (the Triton kernel, triton_qsa.py, has the same): query row i, of sequence seq_idx[i] (its row of
block_tables), attends to the `ratio` tokens of each block id >= 0 in blocks[i] (tokens ratio * b ..
ratio * b + ratio - 1 of the sequence) and to tokens tail_start[i] .. kv_lens[i] - 1; every chosen block ends
before tail_start[i] (checked). K/V are read straight from the paged cache [2, num_blocks, block_size, Hkv,
D] through the block table; query head j reads kv head j // (Hq / Hkv).

Why a kernel: the torch path (qsa.gathered_attention) copies each row's ~budget selected K/V rows out of the
cache, widens them to float32 and repeats nothing less than [rows, tokens, Hkv, D] per tile; the kernel
reads each selected row once per kv head, in the cache's dtype, and keeps a running max and sum per query
head (online softmax in float32). Tasks are (row, kv head), shared out longest first; a batch-1 decode's
few tasks are split over the threads and merged. AVX-512 and AVX2 + FMA builds (the same loops on 16 or
8 lanes); bf16 and float32 caches; float32 out (the caller casts). Built by cpp_build like the other
kernels, on by default where --cpu-paged-attention is (CpuKernels.qsa_attention). A dispatcher op with a
fake kernel: compiled decode steps call it (ember.layers.qsa_graph).
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build

SOURCE = "cpu_qsa_attention.cpp"
HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # compiled specializations (the switch in the .cpp)
MAX_GROUP = 16  # query heads per kv head (kMaxG)
CACHE_DTYPES = (torch.bfloat16, torch.float32)


def _fake_attention(q, kv_cache, block_tables, seq_idx, blocks, tail_start, kv_lens, ratio, scale):
    return q.new_empty(q.shape, dtype=torch.float32)


FAKES = {"ember_cpu::qsa_attention": _fake_attention}  # the shapes torch.compile traces the op with


def available() -> bool:
    """The op can run here (AVX-512 or AVX2 + FMA; loaded, built once first where it was not built at install)."""
    return build(SOURCE, fakes=FAKES) is not None


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
        and available()
    )


def qsa_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_idx: torch.Tensor,
    blocks: torch.Tensor,
    tail_start: torch.Tensor,
    kv_lens: torch.Tensor,
    ratio: int,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] over its selection (the module docstring) -> [T, Hq, D] in q's dtype. Call where supports()."""

    def i32(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.int32).contiguous()

    out = torch.ops.ember_cpu.qsa_attention(
        q.float().contiguous(),
        kv_cache,
        i32(block_tables),
        i32(seq_idx),
        i32(blocks),
        i32(tail_start),
        i32(kv_lens),
        ratio,
        scale,
    )
    return out.to(q.dtype)
