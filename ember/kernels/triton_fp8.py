"""Triton GEMM over block-scaled fp8 e4m3 weights (Qwen's FP8 checkpoints; ember.quant.fp8): y = x @ W^T with
W[n, k] = weight[n, k] * scale[scale_row[n], k // block_k], read straight from the fp8 bytes and the scales.

Each program holds a [BLOCK_M, BLOCK_N] tile of y and walks K in tiles of BLOCK_K dividing block_k, so a
K tile lies in one scale block: its scales are one value per weight row (gathered through scale_row, which
lets a fused layer's parts start mid-block). The tile's bytes are decoded arithmetically (sign, 4-bit
exponent, 3-bit mantissa, subnormals at exponent 0), which the interpreter runs as it runs on a GPU, scaled
in float32, cast to x's dtype and fed to tl.dot with a float32 accumulator. Small M (decode) splits K over
SPLIT_K programs so one row still fills the GPU; the float32 partials are summed after.

triton is imported lazily (a GPU's dependency only); `available()` says whether it is there. Under the
interpreter (TRITON_INTERPRET=1, CPU tensors: the tests) the kernel is built per value of the variable,
as ember.kernels.triton_awq explains, and uses core builtins only (tl.full, not tl.zeros).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BLOCK_K_CHOICES = (64, 32, 16)  # the largest dividing the scale block's width; tl.dot needs K tiles >= 16


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def block_k_for(block_k: int) -> int | None:
    """The K tile for scale blocks block_k wide (None: none fits; the caller dequantizes instead)."""
    return next((b for b in BLOCK_K_CHOICES if block_k % b == 0), None)


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):  # `interpret` is the cache key: @triton.jit reads TRITON_INTERPRET
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_gemm_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        r_ptr,
        y_ptr,
        M,
        N,
        K,
        KB,
        SCALE_K,
        stride_xm,
        stride_ym,
        stride_ysplit,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m, mask_n = offs_m < M, offs_n < N
        srow = tl.load(r_ptr + offs_n, mask=mask_n, other=0)  # each weight row's row of the scale grid
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            a = tl.load(
                x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
            )
            b = tl.load(w_ptr + offs_n[None, :] * K + offs_k[:, None], mask=mask_n[None, :] & mask_k[:, None], other=0)
            b = b.to(tl.int32)  # [BLOCK_K, BLOCK_N] e4m3 bytes: s eeee mmm
            e, m = (b >> 3) & 15, b & 7
            mant = tl.where(e == 0, m, m + 8).to(tl.float32)
            v = mant * tl.exp2((tl.where(e == 0, 1, e) - 10).to(tl.float32))  # (8 + m) 2^(e - 10), or m 2^-9
            v = tl.where((b & 128) != 0, -v, v)
            s = tl.load(s_ptr + srow * KB + k0 // SCALE_K, mask=mask_n, other=0.0)  # the tile is in one block
            w = (v * s[None, :]).to(a.dtype)
            acc += tl.dot(a, w, input_precision=PRECISION)
        out = y_ptr + pid_k * stride_ysplit + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    return triton, fp8_gemm_kernel


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, block_k: int
) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype; weight float8_e4m3fn [N, K], scale float32 [rows, ceil(K / block_k)],
    scale_row int32 [N]. block_k must be a multiple of 16 (block_k_for; the caller dequantizes otherwise)."""
    tile_k = block_k_for(block_k)
    N, K = weight.shape
    if tile_k is None:
        raise ValueError(f"scale blocks {block_k} wide are not a multiple of 16; dequantize and matmul instead")
    triton, gemm = _kernels(_interpret())
    x = x.contiguous()
    M = x.shape[0]
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64 if N >= 64 else 32
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    split_k = max(1, min(triton.cdiv(K, tile_k), 256 // tiles, 16))
    y = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
    gemm[grid](
        x,
        weight.view(torch.uint8),
        scale.contiguous(),
        scale_row.contiguous(),
        y,
        M,
        N,
        K,
        scale.shape[1],
        block_k,
        x.stride(0),
        y.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=tile_k,
        SPLIT_K=split_k,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
    )
    return y[0] if split_k == 1 else y.sum(0).to(x.dtype)
