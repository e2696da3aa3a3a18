"""Triton KV store: write this step's k/v rows into the paged cache at slot_mapping.

kv_cache [2, num_blocks, block_size, Hkv, D]; a token's slot is block_id * block_size + offset,
so one slot is one [Hkv, D] row of the flattened [num_slots, Hkv, D] cache. Slots < 0
(padding rows) are skipped by masking the store, so no host sync is needed to filter them.
FP8 cache: fp8(clamp(x / scale, +-max)) in fp32, as ember.layers.attention.quantize_kv (the
clamp matters for e5m2, whose cast would overflow to inf). The scales are read from device
tensors, not host floats: no sync, and a captured CUDA graph sees the calibrated values.
One program writes BLOCK_T tokens, all heads at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.triton_utils import INTERPRETING, cast_constexprs, check_launch, next_pow2, round_to_format

BLOCK_T = 16


@triton.jit
def kv_store_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    k_scale_ptr,
    v_scale_ptr,
    T,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_slot,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
    ROUND_MBITS: tl.constexpr,
    ROUND_MIN_NORMAL: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + tok, mask=tok < T, other=-1).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)  # one [Hkv, D] row, flattened
    head, d = offs // HEAD_DIM, offs % HEAD_DIM
    write = (slot >= 0)[:, None] & (offs < ROW)[None, :]
    dst = cache_ptr + slot[:, None] * stride_slot + (head * stride_ch + d)[None, :]
    k = tl.load(k_ptr + tok[:, None].to(tl.int64) * stride_kt + (head * stride_kh + d)[None, :], mask=write, other=0.0)
    v = tl.load(v_ptr + tok[:, None].to(tl.int64) * stride_vt + (head * stride_vh + d)[None, :], mask=write, other=0.0)
    k, v = k.to(tl.float32), v.to(tl.float32)
    if FP8:
        k = tl.clamp(k / tl.load(k_scale_ptr), -FP8_MAX, FP8_MAX)
        v = tl.clamp(v / tl.load(v_scale_ptr), -FP8_MAX, FP8_MAX)
    k = round_to_format(k, ROUND_MBITS, ROUND_MIN_NORMAL)
    v = round_to_format(v, ROUND_MBITS, ROUND_MIN_NORMAL)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=write)
    tl.store(dst + stride_kv, v.to(cache_ptr.dtype.element_ty), mask=write)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v [T, Hkv, D] -> kv_cache [2, num_blocks, block_size, Hkv, D] at slot_mapping (-1: skip).

    k_scale / v_scale: fp32 scalar tensors, required (and only used) for an fp8 cache."""
    check_launch(k, kv_cache)
    T, Hkv, D = k.shape
    if T == 0:
        return
    if (
        k.stride(2) != 1
        or v.stride(2) != 1
        or kv_cache.stride(4) != 1
        or kv_cache.stride(3) != D
        or kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2)
    ):
        raise ValueError("store_kv needs unit-stride head dims in k and v and a cache with contiguous blocks")
    fp8 = kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an fp8 KV cache needs k_scale and v_scale")
    scale_args = (k_scale, v_scale) if fp8 else (slot_mapping, slot_mapping)  # never read when not fp8
    kv_store_kernel[(triton.cdiv(T, BLOCK_T),)](
        k,
        v,
        kv_cache,
        slot_mapping,
        *scale_args,
        T,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        HEAD_DIM=D,
        ROW=Hkv * D,
        ROW_PAD=next_pow2(Hkv * D),
        BLOCK_T=BLOCK_T,
        FP8=fp8,
        FP8_MAX=torch.finfo(kv_cache.dtype).max if fp8 else 0.0,
        **cast_constexprs(kv_cache.dtype, INTERPRETING),
    )
