"""SwiGLU gate: the fused gate_up output [.., 2I] -> silu(gate) * up [.., I]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import cpu_fused_elementwise as fused
from ember.kernels.cpu_kernels import CpuKernels


def silu_and_mul(x: torch.Tensor, use_kernel: bool = True) -> torch.Tensor:
    """use_kernel: the layer's CpuKernels.fused_elementwise (the C++ pass where x fits it)."""
    if use_kernel and fused.applies(x):
        return fused.silu_and_mul(x)  # one pass, the same roundings
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def __init__(self, kernels: CpuKernels | None = None):
        super().__init__()
        self.fused = (kernels or CpuKernels()).fused_elementwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x, self.fused)
