"""Triton kernels over AutoAWQ "GEMM" tensors (formats.md §1): y = x @ Wd and Wd itself, where
Wd[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n] is read straight from the packed int32s.

Logical column n of a packed row sits in word n // 8 at bit shift 4 * [0, 4, 1, 5, 2, 6, 3, 7][n % 8]
(= 4 * (j // 2 + 4 * (j % 2)) for j = n % 8). Each program expands its [BLOCK_K, BLOCK_N] weight
tile by loading every word once per logical column it holds (the repeats hit the cache) and
shifting each lane by its own amount, so no interleave/reshape tricks are needed.

The GEMM tiles K by BLOCK_K dividing G, so a K tile lies inside one group and its zeros and
scales are one [BLOCK_N] row each; the dequantized tile is cast to x's dtype and fed to
tl.dot with an fp32 accumulator. Small-M (decode) calls split K across SPLIT_K programs so
a 1-row GEMM still fills the GPU; the fp32 partials are summed afterwards.

triton is imported lazily: ember works without it (CPU), and `available()` says whether it is
there. Interpreter (TRITON_INTERPRET=1, CPU tensors, how the tests run without a GPU): triton
reads the variable when a function is decorated with @triton.jit, so the kernels are built on
first use, once per value of the variable. The helpers triton itself defines with @jit
(tl.zeros, tl.sum, ... in triton.language.standard) were decorated when triton was imported and
fail under the interpreter unless the variable was set before that import; these kernels use
core builtins only (tl.full, not tl.zeros), so they run whatever the import order.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

BLOCK_K_CHOICES = (64, 32, 16)  # the largest that divides G is used; tl.dot needs K tiles >= 16


def available() -> bool:
    return importlib.util.find_spec("triton") is not None


def _interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=2)
def _kernels(interpret: bool):  # `interpret` is the cache key: @triton.jit reads TRITON_INTERPRET
    import triton
    import triton.language as tl

    @triton.jit
    def awq_gemm_kernel(
        x_ptr,
        qw_ptr,
        qz_ptr,
        s_ptr,
        y_ptr,
        M,
        N,
        K,
        G,
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
        word_n = offs_n // 8
        shifts = ((offs_n % 8) // 2 + (offs_n % 2) * 4) * 4  # AWQ's [0, 4, 1, 5, 2, 6, 3, 7] nibbles
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)  # not tl.zeros: see the module docstring
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None], other=0.0)
            words = tl.load(qw_ptr + offs_k[:, None] * (N // 8) + word_n[None, :], mask=mask_n[None, :], other=0)
            q = (words >> shifts[None, :]) & 0xF
            g = k0 // G  # the whole K tile is in one group
            z = (tl.load(qz_ptr + g * (N // 8) + word_n, mask=mask_n, other=0) >> shifts) & 0xF
            s = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            w = ((q - z[None, :]).to(tl.float32) * s[None, :]).to(a.dtype)
            acc += tl.dot(a, w, input_precision=PRECISION)
        out = y_ptr + pid_k * stride_ysplit + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])

    @triton.jit
    def awq_dequantize_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, G, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_k < K)[:, None] & (offs_n < N)[None, :]
        word_n = offs_n // 8
        shifts = ((offs_n % 8) // 2 + (offs_n % 2) * 4) * 4
        g = offs_k // G
        q = (
            tl.load(qw_ptr + offs_k[:, None] * (N // 8) + word_n[None, :], mask=mask, other=0) >> shifts[None, :]
        ) & 0xF
        z = (tl.load(qz_ptr + g[:, None] * (N // 8) + word_n[None, :], mask=mask, other=0) >> shifts[None, :]) & 0xF
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        w = (q - z).to(tl.float32) * s  # exact: a small integer times an fp16 value
        tl.store(out_ptr + offs_k[:, None] * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)

    return triton, awq_gemm_kernel, awq_dequantize_kernel


def _check(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> tuple[int, int]:
    K, N = qweight.shape[0], qweight.shape[1] * 8
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("qweight and qzeros must be int32")
    if not (qweight.is_contiguous() and qzeros.is_contiguous() and scales.is_contiguous()):
        raise ValueError("AWQ tensors must be contiguous")
    if (
        K % group_size
        or tuple(qzeros.shape) != (K // group_size, N // 8)
        or tuple(scales.shape) != (K // group_size, N)
    ):
        raise ValueError(
            f"AWQ tensors disagree: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
            f"scales {tuple(scales.shape)}, group size {group_size}"
        )
    return K, N


def block_k_for(group_size: int) -> int | None:
    """The K tile the GEMM uses for this group size (None: no tile fits, dequantize instead)."""
    return next((b for b in BLOCK_K_CHOICES if group_size % b == 0), None)


def awq_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ Wd [K, N] -> [M, N] in x's dtype, fp32 accumulation. group_size = K for one group."""
    triton, gemm, _ = _kernels(_interpret())
    K, N = _check(qweight, qzeros, scales, group_size)
    block_k = block_k_for(group_size)
    if block_k is None:
        raise ValueError(f"group size {group_size} is not a multiple of 16; use awq_dequantize + matmul")
    x = x.contiguous()
    M = x.shape[0]
    block_m = 16 if M <= 16 else 32 if M <= 32 else 64
    block_n = 64 if N >= 64 else 32
    tiles = triton.cdiv(M, block_m) * triton.cdiv(N, block_n)
    if split_k is None:  # aim for ~256 programs on small M, never more splits than K tiles
        split_k = max(1, min(K // block_k, 256 // tiles, 16))
    y = torch.empty((split_k, M, N), dtype=x.dtype if split_k == 1 else torch.float32, device=x.device)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n), split_k)
    gemm[grid](
        x,
        qweight,
        qzeros,
        scales,
        y,
        M,
        N,
        K,
        group_size,
        x.stride(0),
        y.stride(1),
        y.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        PRECISION="ieee" if x.dtype == torch.float32 else None,
    )
    return y[0] if split_k == 1 else y.sum(0).to(x.dtype)


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Wd [K, N] in `dtype` (default: the scales' dtype, bit-exact with AutoAWQ's fp16 dequantization)."""
    triton, _, dequant = _kernels(_interpret())
    K, N = _check(qweight, qzeros, scales, group_size)
    out = torch.empty((K, N), dtype=dtype or scales.dtype, device=qweight.device)
    block_k, block_n = 32, 64
    dequant[(triton.cdiv(K, block_k), triton.cdiv(N, block_n))](
        qweight, qzeros, scales, out, N, K, group_size, BLOCK_K=block_k, BLOCK_N=block_n
    )
    return out
