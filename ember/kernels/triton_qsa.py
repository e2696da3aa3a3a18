"""QSA selected-block attention on a GPU (qwen4_exp's sparse attention layers): the contract of
cpu_qsa_attention.py in Triton. Query row i attends to the `ratio` tokens of each block id >= 0 in
blocks[i] and to tokens tail_start[i] .. kv_lens[i] - 1 of sequence seq_idx[i], K/V gathered from the paged
cache through its block table.

Program (row, kv head, split): the G query heads of the kv head are the rows of a [BLOCK_M, D_PAD] query
tile (so each gathered K/V tile is read once per kv head, and tl.dot gets M >= 16); it walks positions of
the row's token list, BLOCK_N at a time: position j < K * ratio is token blocks[j // ratio] * ratio + j %
ratio (none where the id is -1), the ratio - 1 positions after it the tail; each token's slot comes from the
block table. Online softmax in float32 (base 2). A decode has few rows, so the list is cut into splits and
merged by triton_decode's merge kernel, as the paged decode kernel does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.triton_decode import LOG2E, _merge_splits, _split_partials, plan_splits, store_partial
from ember.kernels.triton_utils import (
    INTERPRETING,
    cast_constexprs,
    check_launch,
    check_paged_layout,
    dot_precision,
    load_query_tile,
    next_pow2,
    paged_strides,
    store_output,
)

BLOCK_N = 64  # token-list positions per tile on a GPU


@triton.jit
def selected_tile(
    q,
    acc,
    m_i,
    l_i,
    start,
    n_pos,
    blocks_row,
    tail,
    kv_len,
    kv_base,
    bt_row,
    d_ok,
    qk_scale,
    stride_kv,
    stride_slot,
    K,
    RATIO: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Positions start .. start + BLOCK_N - 1 of a row's token list folded into (acc, m_i, l_i)."""
    pos = start + tl.arange(0, BLOCK_N)
    in_blocks = pos < K * RATIO
    blk = tl.load(blocks_row + pos // RATIO, mask=in_blocks, other=-1)
    tok = tl.where(in_blocks, blk * RATIO + pos % RATIO, tail + pos - K * RATIO)
    ok = tl.where(in_blocks, blk >= 0, (pos < n_pos) & (tok < kv_len))
    tok = tl.where(ok, tok, 0)
    page = tl.load(bt_row + tok // BLOCK_SIZE, mask=ok, other=0)
    slot = page.to(tl.int64) * BLOCK_SIZE + tok % BLOCK_SIZE
    kv_mask = ok[:, None] & d_ok[None, :]
    k = tl.load(kv_base + slot[:, None] * stride_slot, mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(kv_base + stride_kv + slot[:, None] * stride_slot, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: no NaN
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def qsa_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_ptr,
    blocks_ptr,
    tail_ptr,
    lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    qk_scale,
    K,
    tiles_per_split,
    stride_qt,
    stride_qh,
    stride_kv,
    stride_slot,
    stride_kvh,
    stride_bt,
    stride_pt,
    stride_ph,
    stride_ps,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    RATIO: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_MBITS: tl.constexpr,
    ROUND_MIN_NORMAL: tl.constexpr,
):
    row, kvh, split = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, BLOCK_M)
    head = kvh * G + g
    row_ok = g < G
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tile_mask = row_ok[:, None] & d_ok[None, :]
    q = load_query_tile(q_ptr + row * stride_qt + head[:, None] * stride_qh + d[None, :], tile_mask, DOT_FP32)
    seq = tl.load(seq_ptr + row)
    tail, kv_len = tl.load(tail_ptr + row), tl.load(lens_ptr + row)
    n_pos = K * RATIO + RATIO - 1
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(n_pos, lo + tiles_per_split * BLOCK_N)
    kv_base = kv_ptr + kvh * stride_kvh + d[None, :]
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.full((BLOCK_M,), 0.0, tl.float32)
    acc = tl.full((BLOCK_M, D_PAD), 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        # fmt: off
        acc, m_i, l_i = selected_tile(q, acc, m_i, l_i, start, hi, blocks_ptr + row * K, tail, kv_len, kv_base,
                                      bt_ptr + seq * stride_bt, d_ok, qk_scale, stride_kv, stride_slot, K, RATIO,
                                      BLOCK_SIZE, BLOCK_N, PRECISION)
        # fmt: on
    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if DIRECT:
        offsets = row * stride_ot + head[:, None] * stride_oh + d[None, :]
        store_output(out_ptr, offsets, o, tile_mask, out_ptr, False, ROUND_MBITS, ROUND_MIN_NORMAL)
    else:
        part = row * stride_pt + head * stride_ph + split * stride_ps
        store_partial(part_out_ptr, part_lse_ptr, part, d, o, m_i, l_i, row_ok, tile_mask, D_PAD)


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
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] over its selection (cpu_qsa_attention's contract) -> [T, Hq, D] in q's dtype. num_splits /
    block_n: override the split count and tile (tests); None picks them for the device."""
    check_launch(q, kv_cache)
    check_paged_layout(q, kv_cache, "qsa_attention")
    _, _, block_size, Hkv, D = kv_cache.shape
    T, Hq = q.shape[:2]
    out = torch.empty_like(q)
    if T == 0:
        return out
    K = blocks.shape[1]
    block_n = block_n or (16 if INTERPRETING else BLOCK_N)
    num_splits, tiles_per_split = plan_splits(T, Hkv, K * ratio + ratio - 1, block_n, q.device, num_splits)
    d_pad = max(16, next_pow2(D))
    dot_fp32, precision = dot_precision(q.dtype, INTERPRETING)
    part_out, part_lse, stride_p = _split_partials(T, Hq, num_splits, d_pad, q.device, out)
    rounding = cast_constexprs(out.dtype, INTERPRETING)
    i32 = [t.to(torch.int32).contiguous() for t in (block_tables, seq_idx, blocks, tail_start, kv_lens)]
    strides = paged_strides(q, kv_cache, i32[0])
    qsa_kernel[(T, Hkv, num_splits)](
        q, kv_cache, *i32, part_out, part_lse, out, scale * LOG2E, K, tiles_per_split, *strides, *stride_p,
        out.stride(0), out.stride(1), G=Hq // Hkv, RATIO=ratio, BLOCK_SIZE=block_size,
        BLOCK_M=max(16, next_pow2(Hq // Hkv)), BLOCK_N=block_n, HEAD_DIM=D, D_PAD=d_pad, DIRECT=num_splits == 1,
        DOT_FP32=dot_fp32, PRECISION=precision, **rounding,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits(part_out, part_lse, stride_p, num_splits, out, out, D, d_pad, False, rounding)
    return out
