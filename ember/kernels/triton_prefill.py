"""Triton varlen prefill attention over the paged KV cache: fresh prompts, chunks of a prompt
over a cached prefix (chunked prefill, prefix caching), and any other step with long queries.

Sequence b's q_len query tokens sit at positions ctx_len..seq_len-1 (ctx_len = seq_len - q_len)
and see every cached key of the prefix plus, causally, the chunk's own keys: token j sees keys
< ctx_len + j + 1. This step's K/V are already in the cache (the attention layer wrote them), so
every key comes from the paged cache and a fresh prompt is just ctx_len = 0.

Grid (sequence, query tile of BLOCK_Q tokens, query head): each program runs a flash-attention
online softmax over the key tiles up to the causal limit of its last row, gathering keys slot by
slot (block_tables[b, p // block_size] * block_size + p % block_size), so a key tile may span
cache blocks. Query tiles past a sequence's q_len do no work. One head per program: prefill is
compute-bound, and the G query heads sharing a kv head read its tiles from L2.
FP8 cache: as triton_decode (k_scale into the score scale, v_scale into the output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.triton_utils import (
    INTERPRETING,
    attend_keys,
    cast_constexprs,
    check_launch,
    check_paged_layout,
    dot_precision,
    fold_k_scale,
    load_query_tile,
    next_pow2,
    paged_strides,
    sequence_extent,
    store_output,
)

LOG2E = 1.4426950408889634
BLOCK_Q, BLOCK_N = 64, 64  # GPU tiles; the interpreter uses 16 x 16 (its cost is per op, not per element)


@triton.jit
def prefill_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    k_scale_ptr,
    v_scale_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_slot,
    stride_kvh,
    stride_bt,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_MBITS: tl.constexpr,
    ROUND_MIN_NORMAL: tl.constexpr,
):
    b, q_tile, head = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kvh = head // G
    q_start, q_len, seq_len = sequence_extent(qsl_ptr, seq_lens_ptr, b)
    ctx_len = seq_len - q_len
    qi = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = qi < q_len
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    tile_mask = row_ok[:, None] & d_ok[None, :]
    q = load_query_tile(q_ptr + tok[:, None] * stride_qt + head * stride_qh + d[None, :], tile_mask, DOT_FP32)
    qk_scale = fold_k_scale(qk_scale, k_scale_ptr, FP8)
    visible_end = ctx_len + qi + 1  # per row: keys < this are visible
    # The tile's last real row sees the most keys; a tile past q_len sees none (hi <= 0).
    hi = tl.minimum(seq_len, ctx_len + tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, q_len))
    hi = tl.where(q_tile * BLOCK_Q < q_len, hi, 0)
    kv_base = kv_ptr + kvh * stride_kvh + d[None, :]
    bt_row = bt_ptr + b * stride_bt
    acc, m_i, l_i = attend_keys(
        q, 0, hi, visible_end, kv_base, bt_row, d_ok, qk_scale, stride_kv, stride_slot, BLOCK_SIZE, BLOCK_N, PRECISION
    )

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_offsets = tok[:, None] * stride_ot + head * stride_oh + d[None, :]
    store_output(out_ptr, out_offsets, o, tile_mask, v_scale_ptr, FP8, ROUND_MBITS, ROUND_MIN_NORMAL)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    block_q: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> out (each sequence's query rows; rows past the last sequence are left alone).

    kv_cache [2, num_blocks, block_size, Hkv, D] already holds this step's K/V. max_query_len:
    host bound that sizes the grid. block_q / block_n: override the tiles (tests)."""
    check_launch(q, kv_cache)
    B = seq_lens.shape[0]
    _, _, block_size, Hkv, D = kv_cache.shape
    Hq = q.shape[1]
    check_paged_layout(q, kv_cache, "paged_prefill_attention")
    if B == 0 or max_query_len == 0:
        return out
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    block_q = block_q or (16 if INTERPRETING else BLOCK_Q)
    block_n = block_n or (16 if INTERPRETING else BLOCK_N)
    dot_fp32, precision = dot_precision(q.dtype, INTERPRETING)
    scales = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)  # never read when not fp8
    num_warps = 8 if D > 64 else 4  # D 128 at 4 warps spills (sm_90)
    prefill_kernel[(B, triton.cdiv(max_query_len, block_q), Hq)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        *scales,
        out,
        scale * LOG2E,
        *paged_strides(q, kv_cache, block_tables),
        out.stride(0),
        out.stride(1),
        G=Hq // Hkv,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=D,
        D_PAD=max(16, next_pow2(D)),
        FP8=fp8,
        DOT_FP32=dot_fp32,
        PRECISION=precision,
        **cast_constexprs(out.dtype, INTERPRETING),
        num_warps=num_warps,
    )
    return out
