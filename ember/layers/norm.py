"""RMSNorm exactly as Hugging Face computes it, with an optional fused residual add."""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels import cpu_fused_elementwise as fused
from ember.kernels.cpu_kernels import CpuKernels


class RMSNorm(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        # the one-pass C++ kernel for bf16 / float32 rows on CPU (chosen at build; applies() checks the tensors)
        self.fused = (kernels or CpuKernels()).fused_elementwise

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel in float32 (the same math as HF's x * rsqrt(mean(x^2) + eps)).
        h = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        # Cast back before the weight multiply, as HF does: this is what makes bf16 bit-exact.
        return self.weight * h.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) when residual is None; else (norm(x + residual), x + residual)."""
        if (
            self.fused
            and fused.applies(x, self.weight)
            and self.weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype)
        ):
            return fused.rms_norm(x, residual, self.weight, self.eps)  # one pass, the same roundings
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class ZeroCenteredRMSNorm(nn.Module):
    """Qwen3-Next / Qwen3.5's norm: the checkpoint stores w - 1, and the multiply by (1 + w) runs
    in float32 before the cast back (HF's order; unlike RMSNorm above, which casts first)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.fused = (kernels or CpuKernels()).fused_elementwise  # as RMSNorm's

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x) when residual is None; else (norm(x + residual), x + residual)."""
        if (
            self.fused
            and fused.applies(x, self.weight)
            and self.weight.dtype == x.dtype
            and (residual is None or residual.dtype == x.dtype)
        ):
            return fused.rms_norm(x, residual, self.weight, self.eps, zero_centered=True)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm, per value head: w * rms(o) (cast to o's dtype first) * act(z),
    the gate in float32; act is SiLU (Qwen3-Next, Qwen3.5) or sigmoid (qwen4_exp's output_gate_type). Its
    weight is stored as is (not zero-centred)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kernels: CpuKernels | None = None,
        activation: str = "silu",
    ):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.activation = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}[activation]
        # as RMSNorm's; the C++ kernel gates with SiLU only
        self.fused = (kernels or CpuKernels()).fused_elementwise and activation == "silu"

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o, z [T, H, D] -> [T, H, D]."""
        if self.fused and self.weight.dtype == o.dtype and fused.applies_gated(o, z, self.weight):
            return fused.gated_rms_norm(o, z, self.weight, self.eps).view(o.shape)  # one pass, the same roundings
        h = torch.rms_norm(o.float(), (o.shape[-1],), eps=self.eps).to(o.dtype)
        return (self.weight * h * self.activation(z.float())).to(o.dtype)
