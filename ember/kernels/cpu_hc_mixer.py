"""qwen4_exp's hyper-connection mixer on CPU (cpu_hc_mixer.cpp; the layer: ember/layers/hyper_connection.py).

Contract, for X [T, n*H] (float32 or bf16) and the norm's gamma [n*H] (float32; the scale is 1 + gamma):
- mix(X, gamma, eps, n, w_down [L, n*H], w_up [n*H, L], w_inject [n, n*H] or None) -> (x [T, H], w [T, n] or
  [T, 0]) in X's dtype, the whole mixer in one pass a tile of rows: Xn = RMS-per-stream(X) * (1 + gamma) (float32,
  rounded to X's dtype as the torch path casts), a = SiLU(W_down Xn / n), x = mean_s(sigmoid(W_up a)_s * Xn_s),
  w = 2 sigmoid(W_inject Xn / n). The matrices dense, all float32 or all bf16 (a bf16 matrix under float32
  X is a GGUF BF16 file's or --cpu-half-weights'); intermediates float32.
- norm(X, gamma, eps, n) -> Xn in X's dtype, and gate(z, Xn, inject_logits or None, n) -> (x, w): the same
  two ends around projections computed outside (packed GGUF parts, tensor-parallel shards, or many rows,
  where torch's GEMM beats the fused tile: FUSED_MAX_ROWS).

Why a kernel: the torch path makes ~12 passes over [T, n*H] tensors (a float copy, the norm, the gamma, the
cast, the gate's sigmoid, the product, the mean; the inject's sigmoid) and two GEMVs that each read their weight
once; at decode those elementwise passes cost about what the GEMVs do. AVX-512 and AVX2 + FMA builds (16 or 8
float lanes, the same loops). On by default with --cpu-fused-elementwise (CpuKernels.hc_mixer); never inside
torch.compile (no fake kernels: traced graphs keep the torch ops).
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build
from ember.kernels.tracing import tracing

SOURCE = "cpu_hc_mixer.cpp"
DTYPES = (torch.float32, torch.bfloat16)
# Rows up to which mix() runs (dense matrices); above, norm / torch's GEMMs / gate (docs/tuning.md, the
# hyper-connection mixer: the fused tile's FMA loop against MKL's GEMM).
FUSED_MAX_ROWS = 24


def available() -> bool:
    """The ops can run here (AVX-512 or AVX2 + FMA; loaded, built once first where they were not built at install)."""
    return build(SOURCE) is not None


def applies(X: torch.Tensor) -> bool:
    """X is rows the kernel takes (CPU, float32 / bf16, 2-D, an eager step) and it is built."""
    return X.device.type == "cpu" and X.dtype in DTYPES and X.dim() == 2 and not tracing(X) and available()


def mix(X, gamma, eps: float, n: int, w_down, w_up, w_inject=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole mixer (the module docstring). Call where applies(X)."""
    return torch.ops.ember_cpu.hc_mix(X.contiguous(), _f32(gamma), eps, n, w_down, w_up, w_inject)


def norm(X: torch.Tensor, gamma: torch.Tensor, eps: float, n: int) -> torch.Tensor:
    """Xn [T, n*H] in X's dtype: each stream's RMS norm times 1 + gamma. Call where applies(X)."""
    return torch.ops.ember_cpu.hc_norm(X.contiguous(), _f32(gamma), eps, n)


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def gate(z: torch.Tensor, xn: torch.Tensor, inject: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [T, H], w [T, n] or [T, 0]) from the up projection's logits z [T, n*H], Xn and the inject logits."""
    inject = None if inject is None else inject.to(xn.dtype).contiguous()
    return torch.ops.ember_cpu.hc_gate(z.to(xn.dtype).contiguous(), xn, inject, n)
