"""qwen4_exp's PLE after its two projections, in one op on CPU (cpu_ple.cpp): ember.layers.ple.PLELayer.mix.

For B sequences of n tokens (rows sequence-major, T = B n), S streams of H, a conv of K taps, dilation N:
    k = norm_k(kp) [S, H],  q = norm_q(x) [S, H]                   grouped zero-centred RMS norms, per stream
    g_s = <k_s, q_s> / sqrt(H);  g_s = sign(g_s) sqrt(max(|g_s|, 1e-6));  u_s = sigmoid(g_s) v
    columns = [window0 | norm_c(u)]                                 [B, (K - 1) N + n, S H]
    out = u + SiLU(sum_i w[:, i] * columns[window + j - N (K - 1 - i)])
Returns (out [T, S H], columns): the caller writes the state (the last (K - 1) N columns) where it goes.

Why a kernel: in torch this is ~20 ops a step (three norms in float32 with their casts, the gate's
reductions, a cat, a conv1d over a transposed view, a SiLU and an add), each a dispatch and a trip through
memory: an eager decode paid for every one. Here one task per (token, stream) computes its gate, value and
normed conv input from rows widened once, then one per (token, stream) its conv taps, SiLU and sum.
Numerics follow the torch path (PLELayer.mix_reference): float32 math, rounded to the model's dtype
wherever a torch op in that dtype stores (the norms' outputs, each product of the gate's dot, the gate, u,
the conv's sum and its SiLU). float32 and bf16; AVX-512 (16 lanes) or AVX2 + FMA (8 lanes) builds, made by
ember.kernels.cpp_build like the other kernels; a dispatcher op with a fake kernel, so compiled decode
graphs call it. On where --cpu-fused-elementwise is (CpuKernels.ple).
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build

SOURCE = "cpu_ple.cpp"
DTYPES = (torch.float32, torch.bfloat16)


def _fake_mix(x, kp, v, gk, gq, gc, weight, window0, eps, dilation):
    B, window, W = window0.shape
    return x.new_empty(x.shape), x.new_empty((B, window + x.shape[0] // B, W))


FAKES = {"ember_cpu::ple_mix": _fake_mix}  # the shapes torch.compile traces the op with


def available() -> bool:
    """The op can run here (AVX-512 or AVX2 + FMA; loaded, built once first where it was not built at install)."""
    return build(SOURCE, fakes=FAKES) is not None


def supports(x: torch.Tensor, kp: torch.Tensor, v: torch.Tensor, window0: torch.Tensor) -> bool:
    """Tensors the op takes (else the caller runs the torch form)."""
    return (
        x.device.type == "cpu"
        and x.dtype in DTYPES
        and kp.dtype == v.dtype == window0.dtype == x.dtype
        and window0.shape[0] > 0
        and available()
    )


def ple_mix(x, kp, v, gk, gq, gc, weight, window0, eps: float, dilation: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x, kp [T, S*H], v [T, H], the three norms' weights [S*H], the conv's weight [S*H, K], window0
    [B, (K - 1) dilation, S*H], all in one dtype -> (out [T, S*H], columns [B, window + T / B, S*H]). Call
    where supports()."""
    return torch.ops.ember_cpu.ple_mix(
        x.contiguous(),
        kp.contiguous(),
        v.contiguous(),
        gk.contiguous(),
        gq.contiguous(),
        gc.contiguous(),
        weight.contiguous(),
        window0.contiguous(),
        eps,
        dilation,
    )
