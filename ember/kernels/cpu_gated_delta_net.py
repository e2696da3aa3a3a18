"""Gated DeltaNet's decode and verify step on CPU in two fused ops (cpu_gated_delta_net.cpp): the
causal conv update with its SiLU, and the gated delta rule over the state in its slot.

Why: in torch a decode step of one GDN layer is dozens of small ops (the conv's cat, multiply, sum
and SiLU, a split, two L2 norms, the softplus / exp gate, the sigmoid, a repeat of the key heads,
then 4-6 ops of recurrence over the state, and a gather and a scatter of every slot's state), each a
dispatch and a trip through memory. llama.cpp gained 27% on Qwen3.5-0.8B by fusing the recurrence
into one op and 50% on Qwen3-Next from updating the state in place (hybrid-fast.md, section 6).
Here one task per (sequence, value head) prepares its q, k (L2-normalised, q scaled by dk^-0.5),
v, decay exp(g) and beta in float32, then takes the fp32 state [dk, dv] two vectors of columns at a
time (16 KiB for dk = 128 on AVX-512: it stays in L1) through all of the step's tokens:
    kv = S^T k;  delta = beta (v - decay kv);  S = decay S + k delta^T;  o = S^T q
so each state element is read once from its slot and written once where it goes (SGLang's CPU
kernel's single pass; llama.cpp makes four passes over the state per token). Columns of the state
are independent, so a verify's tokens run inside the stripe loop and the state never leaves L1
between them.

Layouts (the RecurrentState pool's): the SSM state [slots, Hv, dk, dv] float32, the conv state
[slots, C, K - 1] in the model's dtype, C = 2 Hk dk + Hv dv channels [q | k | v]; value head h
reads key head h // (Hv / Hk) (grouped, as HF and FLA). src_idx [N] names the slot each sequence
starts from (-1: a new sequence, zeros), dst_idx [N] the slot its state after the step is written
to in place (-1: not written). A verify keeps the state after every token (states_out
[N, T, Hv, dk, dv]) and the conv window (windows_out [N, C, K - 1 + T]), the layout
RecurrentState.keep_verify takes, so a rejected draft is rolled back by picking an index.

Numerics follow GatedDeltaNet's torch path: float32 throughout, beta = sigmoid(b) rounded to the
model's dtype (as b.sigmoid() is there), the conv's sum rounded to the model's dtype before its
SiLU. Built once per machine like the other kernels (ember.kernels.cpp_build): AVX-512 (16 lanes)
or AVX2 + FMA (8 lanes). Both are dispatcher ops with fake kernels, so compiled graphs call them.
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build

SOURCE = "cpu_gated_delta_net.cpp"
MAX_CONV_KERNEL = 16  # kMaxConvKernel


def _fake_gdn(qkv, a, b, A_log, dt_bias, state, src_idx, dst_idx, states_out):
    return qkv.new_empty((qkv.shape[0], state.shape[1] * state.shape[3]))


def _fake_conv(x, weight, conv_state, src_idx, dst_idx, windows_out):
    return x.new_empty((x.shape[0], x.shape[1]))


# the shapes torch.compile traces the ops with
FAKES = {"ember_cpu::gated_delta_net": _fake_gdn, "ember_cpu::causal_conv1d_silu": _fake_conv}


def available() -> bool:
    """The ops can run here (AVX-512 or AVX2 + FMA; loaded, built once first where they were not)."""
    return build(SOURCE, fakes=FAKES) is not None


DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # of the activations and conv state the ops take


def gated_delta_net(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    states_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """N = len(src_idx) sequences of T tokens each, rows sequence-major. qkv [N*T, C] (the conv
    output), a, b [N*T, Hv] (rows contiguous, any row stride); state [slots, Hv, dk, dv] float32,
    written in place at dst_idx; states_out [N, T, Hv, dk, dv] float32 or None. Returns o [N*T, Hv*dv]
    in qkv's dtype. A dst slot may be its own sequence's src, never another sequence's."""
    return torch.ops.ember_cpu.gated_delta_net(qkv, a, b, A_log, dt_bias, state, src_idx, dst_idx, states_out)


def causal_conv1d_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
    windows_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [N*T, C] (rows contiguous), weight [C, K], conv_state [slots, C, K - 1] in x's dtype, written
    in place at dst_idx; windows_out [N, C, K - 1 + T] or None. Returns silu(conv(x)) [N*T, C]."""
    return torch.ops.ember_cpu.causal_conv1d_silu(x, weight, conv_state, src_idx, dst_idx, windows_out)
