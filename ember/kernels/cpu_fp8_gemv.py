"""x @ W^T on CPU for block-scaled fp8 e4m3 weights under float32 activations (cpu_fp8_gemv.cpp).

Why: Qwen's official FP8 checkpoints (Qwen3-*-FP8, Qwen3.8-27B-FP8, Qwen3.8-Flash-Next-FP8) hold every
large matrix as float8_e4m3fn bytes with a float32 scale per 128 x 128 block (ember.quant.fp8). Kept so,
a decode step reads one byte a weight: half of bf16's, a quarter of float32's. This kernel decodes the
bytes in registers a tile at a time, scales each block by its own scale and multiplies, with no dense copy
of the weight anywhere.

Few rows of x (up to `gemv_max_rows`: ember.quant.gemm_dispatch.FP8_GEMV_MAX_ROWS) run the kernel's GEMV;
more (prefill) decode a cache-sized panel of weight rows at a time for torch's float32 GEMM. Both give the
float32 products weight * scale of the torch reference (ember.quant.fp8_blocks.dequantize); only the
order of the float32 sums differs. Needs AVX2 + FMA + F16C; built like the other kernels
(ember.kernels.cpp_build), with an AVX-512 path where the machine has it.
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build


def available() -> bool:
    """True when the op can run here (loaded; built once first where it was not built at install)."""
    return build("cpu_fp8_gemv.cpp", fakes={"ember_cpu::fp8_linear": _fake}) is not None


def _fake(x, w, scale, scale_row, block_k, gemv_max_rows):
    """Shapes for torch.compile's tracing: the op is an opaque call in a compiled graph."""
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def linear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, block_k: int, gemv_max_rows: int
) -> torch.Tensor:
    """x float32 [M, K] @ (w float8_e4m3fn [N, K] scaled by scale[scale_row[n], k // block_k])^T -> float32
    [M, N]; scale float32 [rows, ceil(K / block_k)], scale_row int32 [N]. All contiguous."""
    return torch.ops.ember_cpu.fp8_linear(x, w, scale, scale_row, block_k, gemv_max_rows)
