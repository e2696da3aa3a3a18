"""Triton split-KV ("flash-decoding") paged attention for short queries: decodes (q_len 1) and
speculative verifies (q_len 1 + k), over the varlen step shape of AttentionMetadata.

Why split: a decode step has one query row per sequence, so one program per (sequence, kv head)
leaves most of a GPU idle while it walks a long context. The context is cut into num_splits
slices of tiles_per_split key tiles; program (b, kv head, split) runs an online softmax (running
max m, sum l, accumulator acc, base 2) over its slice only and writes its normalised partial
output and log-sum-exp. A second kernel merges the splits of each (token, head):
out = sum_s 2^(lse_s - max lse) * o_s / sum_s 2^(lse_s - max lse). A split past a sequence's
end has lse = -inf and weight 0. With one split the first kernel writes the output directly.

Why GQA-grouped: the G = Hq / Hkv query heads of a kv head, times the q_len query tokens of the
sequence, are the rows of one program's [BLOCK_M, D] query tile (row r = token r // G, head
r % G), so each K/V tile is read once per group, and tl.dot gets M >= 16 rows even for a decode.

Causality (verify): query token j of a sequence with seq_len L and q_len n sits at position
L - n + j and sees keys < L - n + j + 1; a decode (n = 1) sees all L.

Paged reads: key position p lives in slot block_tables[b, p // block_size] * block_size +
p % block_size; the kernel gathers per key, so a key tile (BLOCK_N keys) may span several
cache blocks and any power-of-two block size works.

FP8 cache: K/V load as fp8 and widen exactly to the dot dtype; k_scale folds into the score
scale and v_scale into the output (softmax weights sum to 1), both read from device scalars.
"""

from __future__ import annotations

import functools

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
BLOCK_N = 64  # keys per tile on a GPU
MAX_SPLITS = 32


@triton.jit
def decode_split_kernel(
    q_ptr,
    kv_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    k_scale_ptr,
    v_scale_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    qk_scale,
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
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    FP8: tl.constexpr,
    DIRECT: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    ROUND_MBITS: tl.constexpr,
    ROUND_MIN_NORMAL: tl.constexpr,
):
    b, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start, q_len, seq_len = sequence_extent(qsl_ptr, seq_lens_ptr, b)
    rows = tl.arange(0, BLOCK_M)
    qi, head = rows // G, kvh * G + rows % G  # row r: query token r // G, head r % G of this kv head's group
    row_ok = qi < q_len
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    tok = (q_start + qi).to(tl.int64)
    tile_mask = row_ok[:, None] & d_ok[None, :]
    q = load_query_tile(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], tile_mask, DOT_FP32)
    qk_scale = fold_k_scale(qk_scale, k_scale_ptr, FP8)
    visible_end = seq_len - q_len + qi + 1  # per row: keys < this are visible
    lo = split * tiles_per_split * BLOCK_N
    hi = tl.minimum(seq_len, lo + tiles_per_split * BLOCK_N)
    kv_base = kv_ptr + kvh * stride_kvh + d[None, :]
    bt_row = bt_ptr + b * stride_bt
    acc, m_i, l_i = attend_keys(
        q, lo, hi, visible_end, kv_base, bt_row, d_ok, qk_scale, stride_kv, stride_slot, BLOCK_SIZE, BLOCK_N, PRECISION
    )

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    if DIRECT:
        out_offsets = tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        store_output(out_ptr, out_offsets, o, tile_mask, v_scale_ptr, FP8, ROUND_MBITS, ROUND_MIN_NORMAL)
    else:
        part = tok * stride_pt + head * stride_ph + split * stride_ps  # each row's (token, head, split)
        store_partial(part_out_ptr, part_lse_ptr, part, d, o, m_i, l_i, row_ok, tile_mask, D_PAD)


@triton.jit
def store_partial(part_out_ptr, part_lse_ptr, part, d, o, m_i, l_i, row_ok, tile_mask, D_PAD: tl.constexpr):
    """One split's normalised output o of each row, at its (token, head, split) index part, and its
    log-sum-exp (base 2) for the merge; -inf where the split held none of the row's keys (weight 0)."""
    tl.store(part_out_ptr + part[:, None] * D_PAD + d[None, :], o, mask=tile_mask)
    has_keys = l_i > 0.0
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + part, lse, mask=row_ok)


@triton.jit
def merge_splits_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    v_scale_ptr,
    num_splits,
    stride_pt,
    stride_ph,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    FP8: tl.constexpr,
    ROUND_MBITS: tl.constexpr,
    ROUND_MIN_NORMAL: tl.constexpr,
):
    tok, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    base = tok * stride_pt + head * stride_ph + splits
    lse = tl.load(part_lse_ptr + base, mask=splits < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 always has key 0, so the max is finite
    o = tl.load(part_out_ptr + base[:, None] * D_PAD + d[None, :], mask=(splits < num_splits)[:, None], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    store_output(
        out_ptr,
        tok * stride_ot + head * stride_oh + d,
        out,
        d < HEAD_DIM,
        v_scale_ptr,
        FP8,
        ROUND_MBITS,
        ROUND_MIN_NORMAL,
    )


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    block_n: int,
    device: torch.device,
    num_splits: int | None = None,
) -> tuple[int, int]:
    """(num_splits, tiles_per_split) for the longest sequence's key tiles. By default enough
    (sequence, kv head, split) programs to fill the GPU about twice, never more splits than
    tiles; the interpreter (CPU) runs programs one by one, so at most 2 there."""
    num_tiles = triton.cdiv(max_seq_len, block_n)
    if num_splits is None:
        want = triton.cdiv(2 * _num_sms(device), num_seqs * num_kv_heads) if device.type == "cuda" else 2
        num_splits = min(want, MAX_SPLITS)
    num_splits = max(1, min(num_splits, num_tiles))
    tiles_per_split = triton.cdiv(num_tiles, num_splits)
    return triton.cdiv(num_tiles, tiles_per_split), tiles_per_split  # no split that every sequence leaves empty


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    num_tokens: int,
    scale: float,
    out: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] -> out[:num_tokens] (the step's real tokens; rows past them are left alone).

    kv_cache [2, num_blocks, block_size, Hkv, D] already holds this step's K/V. max_query_len /
    max_seq_len: host bounds over the sequences (they size the grid). num_splits / block_n:
    override the split count and key tile (tests); None picks them for the device."""
    check_launch(q, kv_cache)
    B = seq_lens.shape[0]
    _, _, block_size, Hkv, D = kv_cache.shape
    Hq = q.shape[1]
    G = Hq // Hkv
    check_paged_layout(q, kv_cache, "paged_decode_attention")
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if B == 0 or num_tokens == 0:
        return out
    block_n = block_n or (16 if INTERPRETING else BLOCK_N)
    num_splits, tiles_per_split = plan_splits(B, Hkv, max_seq_len, block_n, q.device, num_splits)
    d_pad = max(16, next_pow2(D))
    block_m = max(16, next_pow2(max_query_len * G))
    dot_fp32, precision = dot_precision(q.dtype, INTERPRETING)
    part_out, part_lse, stride_p = _split_partials(num_tokens, Hq, num_splits, d_pad, q.device, out)
    scales = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)  # never read when not fp8
    rounding = cast_constexprs(out.dtype, INTERPRETING)
    num_warps = 4 if block_m * d_pad <= 16 * 128 else 8  # larger (verify) row tiles spill at 4 warps on sm_90
    decode_split_kernel[(B, Hkv, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        *scales,
        part_out,
        part_lse,
        out,
        scale * LOG2E,
        tiles_per_split,
        *paged_strides(q, kv_cache, block_tables),
        *stride_p,
        out.stride(0),
        out.stride(1),
        G=G,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HEAD_DIM=D,
        D_PAD=d_pad,
        FP8=fp8,
        DIRECT=num_splits == 1,
        DOT_FP32=dot_fp32,
        PRECISION=precision,
        **rounding,
        num_warps=num_warps,
    )
    if num_splits > 1:
        _merge_splits(part_out, part_lse, stride_p, num_splits, out, scales[1], D, d_pad, fp8, rounding)
    return out


def _merge_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    stride_p: tuple[int, ...],
    num_splits: int,
    out: torch.Tensor,
    v_scale: torch.Tensor,
    head_dim: int,
    d_pad: int,
    fp8: bool,
    rounding: dict,
) -> None:
    """The second kernel: each (token, head)'s split outputs weighted by their log-sum-exps into out."""
    num_tokens, num_heads = part_lse.shape[:2]
    merge_splits_kernel[(num_tokens, num_heads)](
        part_out,
        part_lse,
        out,
        v_scale,
        num_splits,
        stride_p[0],
        stride_p[1],
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        S_PAD=max(2, next_pow2(num_splits)),
        FP8=fp8,
        **rounding,
    )


def _split_partials(
    num_tokens: int, num_heads: int, num_splits: int, d_pad: int, device: torch.device, out: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """(part_out, part_lse, their (token, head, split) strides): where the splits leave their outputs
    and log-sum-exps for the merge. One split writes out directly: out stands in, never touched."""
    if num_splits == 1:
        return out, out, (0, 0, 0)
    part_lse = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32, device=device)
    part_out = torch.empty((num_tokens, num_heads, num_splits, d_pad), dtype=torch.float32, device=device)
    return part_out, part_lse, part_lse.stride()
