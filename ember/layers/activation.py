"""SwiGLU gate: the fused gate_up output [.., 2I] -> silu(gate) * up [.., I]."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import cpu_fused_elementwise as fused


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if fused.applies(x):
        return fused.silu_and_mul(x)  # one pass, the same roundings
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
