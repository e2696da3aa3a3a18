"""Hyper-connections (qwen4_exp): n residual streams, and a low-rank gated mixer before every sublayer in
place of its RMSNorm (the final norm included).

The residual X is [T, n * H]: n streams of H. A mixer normalises each stream on its own (RMS over its H
values, then (1 + gamma), per-stream gammas: a grouped zero-centred norm, float32 math), and from the
normalised streams Xn computes
    a = SiLU(W_down Xn / n),   G = sigmoid(W_up a)  [n, H],   x = mean_s(G_s * Xn_s)   (the sublayer's input)
    w = 2 sigmoid(W_inject Xn / n)  [n]                                             (how much each stream takes)
and after the sublayer each stream adds the same output with its own weight: X_s += w_s * y. The final
mixer has no inject weights: its x is the model's last hidden state. Streams are never mixed with one
another (no comb matrix, unlike DeepSeek-V4's mHC).

On CPU (cpu_kernel: CpuKernels.hc_mixer) the C++ mixer (ember.kernels.cpu_hc_mixer) runs it: the whole of it
in one pass where the three matrices are plain bf16 / float32 ones and the step has few rows, else its norm and
gated-mean ends around the layer's own projections (packed GGUF parts, tensor-parallel shards, prefill GEMMs).
The torch form below is the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.kernels import cpu_hc_mixer
from ember.layers.linear import DenseMethod, ReplicatedLinear, RowParallelLinear


class GroupedZeroCenteredRMSNorm(nn.Module):
    """RMS over each group of `group` values (one stream), times (1 + w) over the whole width, in float32 and
    cast back after the multiply (transformers' Qwen4ExpTextRMSNorm with a group size)."""

    def __init__(self, width: int, group: int, eps: float, dtype, device):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(width, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float().unflatten(-1, (-1, self.group))
        h = torch.rms_norm(h, (self.group,), eps=self.eps).flatten(-2)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class HyperConnection(nn.Module):
    """One mixer: forward(X [T, n*H]) -> (x [T, H], w [T, n]), or x alone for the final one (inject=False)."""

    def __init__(
        self,
        hidden: int,
        count: int,
        lowrank: int,
        eps: float,
        dtype,
        device,
        inject: bool = True,
        quant_method=lambda name: None,
        cpu_kernel: bool = False,
    ):
        """quant_method(name) -> the QuantMethod of the mixer's projection `name` (down, up, inject), or None;
        cpu_kernel: the C++ mixer where it applies (CpuKernels.hc_mixer)."""
        super().__init__()
        self.hidden, self.count, self.eps, self.cpu_kernel = hidden, count, eps, cpu_kernel
        width = hidden * count
        self.hc_norm = GroupedZeroCenteredRMSNorm(width, hidden, eps, dtype, device)
        linear = lambda n_in, n_out, name: ReplicatedLinear(  # noqa: E731
            n_in, n_out, dtype=dtype, device=device, quant_method=quant_method(name)
        )
        # split by input under tensor parallelism: each rank multiplies its slice of the normed streams and one
        # all-reduce of [T, lowrank] sums them; on the release that keeps 1/tp of the 97 mixers' 318M down
        # weights a rank (the up-projection and inject weights stay whole: the gate needs every channel)
        self.input_mix_weight_down = RowParallelLinear(
            width, lowrank, dtype=dtype, device=device, quant_method=quant_method("input_mix_weight_down")
        )
        self.input_mix_weight_up = linear(lowrank, width, "input_mix_weight_up")
        self.block_inject_weight = linear(width, count, "block_inject_weight") if inject else None

    def forward(self, X: torch.Tensor):
        if self.cpu_kernel and not self._training(X) and cpu_hc_mixer.applies(X):
            return self._forward_cpu(X)
        Xn = self.hc_norm(X)
        down = self.input_mix_weight_down
        part = Xn if down.tp_size == 1 else Xn.narrow(-1, down.tp_rank * down.in_features, down.in_features)
        a = F.silu(down(part) / self.count)
        gate = torch.sigmoid(self.input_mix_weight_up(a)).unflatten(-1, (self.count, self.hidden))
        x = (gate * Xn.unflatten(-1, (self.count, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return x
        return x, 2 * torch.sigmoid(self.block_inject_weight(Xn) / self.count)

    def _forward_cpu(self, X: torch.Tensor):
        """forward through the C++ mixer: fused where the matrices are plain and the rows few, else its two ends."""
        gamma, n = self.hc_norm.weight, self.count
        weights = self.plain_weights()
        if weights is not None and X.shape[0] <= cpu_hc_mixer.FUSED_MAX_ROWS:
            x, w = cpu_hc_mixer.mix(X, gamma, self.eps, n, *weights)
        else:
            Xn = cpu_hc_mixer.norm(X, gamma, self.eps, n)
            down = self.input_mix_weight_down
            part = Xn if down.tp_size == 1 else Xn.narrow(-1, down.tp_rank * down.in_features, down.in_features)
            z = self.input_mix_weight_up(F.silu(down(part) / n))
            inject = None if self.block_inject_weight is None else self.block_inject_weight(Xn)
            x, w = cpu_hc_mixer.gate(z, Xn, inject, n)
        return x if self.block_inject_weight is None else (x, w)

    def _training(self, X: torch.Tensor) -> bool:
        """A forward autograd follows (ember.train.mtp): the kernel has no backward."""
        return torch.is_grad_enabled() and (X.requires_grad or any(p.requires_grad for p in self.parameters()))

    def plain_weights(self) -> tuple[torch.Tensor, ...] | None:
        """(down, up, inject or None): the three matrices where each is one plain [out, in] matrix of one dtype the
        fused kernel reads (bf16 / float32: a dense Linear, a GGUF file's F32 / BF16 or dequantized tensor), whole
        on this rank; else None."""
        if self.input_mix_weight_down.tp_size != 1:
            return None
        linears = [self.input_mix_weight_down, self.input_mix_weight_up, self.block_inject_weight]
        ws = [plain_weight(lin) for lin in linears if lin is not None]
        if any(w is None for w in ws) or len({w.dtype for w in ws}) != 1 or ws[0].dtype not in cpu_hc_mixer.DTYPES:
            return None
        return ws[0], ws[1], ws[2] if len(ws) == 3 else None

    @staticmethod
    def inject(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """X [T, n*H] plus y [T, H] into each stream s with weight w[:, s]."""
        return X + (w.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)


def plain_weight(linear) -> torch.Tensor | None:
    """The Linear's weight as one contiguous [out, in] CPU matrix where it is held so (DenseMethod, or a GGUF layer
    packed into one DensePart / HalfPart: `plain_matrix`), else None."""
    if isinstance(linear.quant_method, DenseMethod):
        w = linear.weight
    else:
        parts = getattr(linear, "gguf_parts", None)
        if getattr(linear, "gguf_pending", None) or not parts or len(parts) != 1:
            return None
        w = parts[0].w if getattr(parts[0], "plain_matrix", False) else None
    return w if w is not None and w.dim() == 2 and w.is_contiguous() and w.device.type == "cpu" else None
