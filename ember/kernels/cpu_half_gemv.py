"""x @ W^T on CPU for bf16 / fp16 weights under float32 activations (cpu_half_gemv.cpp).

Why: on CPUs without AVX-512 BF16 (Zen2/3, Intel's 12th-14th gen desktop chips) the engine computes
in float32, and a bf16 checkpoint's dense weights used to be widened to float32 at load: twice the
file's bytes in RAM, and twice the bytes every decode step streams, on a step that is nothing but
memory reads (the hybrid bench's bf16 file decoded at 0.87x llama.cpp at 99% of the measured
bandwidth, with 1.76x its peak RSS; benchmarks/hybrid-avx2.md). This kernel keeps the file's 16-bit
weights and widens them in registers: the same float32 products (a bf16 or fp16 weight is exact in
float32), half the bytes.

Few rows of x run the kernel's GEMV; from more than `gemv_max_rows` rows (ember.quant.gemm_dispatch.
HALF_GEMV_MAX_ROWS: prefill) it widens the weight a cache-sized panel at a time for torch's float32
GEMM, with no float32 copy of the whole weight. Needs AVX2 + FMA + F16C (so AVX-512 machines that run
float32 have it too). Built like the other kernels (ember.kernels.cpp_build).
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build

DTYPES = (torch.bfloat16, torch.float16)  # the weights it takes; x and y are float32


def available() -> bool:
    """True when the op can run here (loaded; built once first where it was not built at install)."""
    return build("cpu_half_gemv.cpp", fakes={"ember_cpu::half_linear": _fake}) is not None


def _fake(x, w, gemv_max_rows):
    """Shapes for torch.compile's tracing: the op is an opaque call in a compiled graph."""
    return x.new_empty((x.shape[0], w.shape[0]), dtype=torch.float32)


def linear(x: torch.Tensor, w: torch.Tensor, gemv_max_rows: int) -> torch.Tensor:
    """x float32 [M, K] (contiguous) @ w [N, K] (bf16 / fp16, contiguous)^T -> float32 [M, N]."""
    return torch.ops.ember_cpu.half_linear(x, w, gemv_max_rows)
