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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.linear import ReplicatedLinear, RowParallelLinear


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
    ):
        """quant_method(name) -> the QuantMethod of the mixer's projection `name` (down, up, inject), or None."""
        super().__init__()
        self.hidden, self.count = hidden, count
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
        Xn = self.hc_norm(X)
        down = self.input_mix_weight_down
        part = Xn if down.tp_size == 1 else Xn.narrow(-1, down.tp_rank * down.in_features, down.in_features)
        a = F.silu(down(part) / self.count)
        gate = torch.sigmoid(self.input_mix_weight_up(a)).unflatten(-1, (self.count, self.hidden))
        x = (gate * Xn.unflatten(-1, (self.count, self.hidden))).mean(dim=-2)
        if self.block_inject_weight is None:
            return x
        return x, 2 * torch.sigmoid(self.block_inject_weight(Xn) / self.count)

    @staticmethod
    def inject(X: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """X [T, n*H] plus y [T, H] into each stream s with weight w[:, s]."""
        return X + (w.unsqueeze(-1) * y.unsqueeze(-2)).flatten(-2)
