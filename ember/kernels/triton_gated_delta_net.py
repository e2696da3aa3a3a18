"""Gated DeltaNet on a GPU in two Triton kernels, with the CPU ops' interface (cpu_gated_delta_net.py):
the causal conv update with its SiLU, and the gated delta rule over the state in its slot. Each runs a
decode (T = 1), a verify (T = 1 + drafts, keeping what a rollback needs) or a varlen prefill (prompts
of different lengths, each from its own slot) in one launch.

Why one program per (sequence, value head, BV columns of the state): the state's columns are
independent, so a program keeps its fp32 block S [dk, BV] in registers through all of its
sequence's tokens and touches the slot twice, one read from src and one write to dst. Per token

    S <- exp(g) S;   u = beta (v - S^T k);   S <- S + k u^T;   o = S^T q

(gated_delta_rule.recurrent's order), q and k L2-normalised in fp32 (eps 1e-6), q scaled by
dk^-0.5, g = -exp(A_log) softplus(a + dt_bias) in fp32, beta = sigmoid(b) rounded to the model's
dtype, as GatedDeltaNet's torch path does. The q / k / gate work is repeated by the dv / BV
programs of a head: a few hundred flops against dk x BV of state, cheaper than a second kernel and
a trip through memory. A prefill runs token by token here (the chunked WY form is the torch path's);
this is the form every sequence of a step can share, whatever its length.

Why the conv is one program per (sequence, BC channels), every tensor 1-D over the channels: each
channel belongs to one thread in every load and store, so a sequence whose dst slot is its own src
(the usual case) reads its initial window before it overwrites it without a barrier. The K taps
are reloaded per token (an L1 hit) rather than kept in a register ring, so any K works.

Layouts (the RecurrentState pool's, as the CPU ops): the SSM state [slots, Hv, dk, dv] float32; the
conv state [slots, C, K - 1] in the model's dtype, C = 2 Hk dk + Hv dv channels [q | k | v]; value
head h reads key head h // (Hv / Hk). src_idx [N]: the slot each sequence starts from (-1: zeros);
dst_idx [N]: the slot its state after its last token goes to, in place (-1: not written). A dst slot
may be its own sequence's src, never another sequence's src or dst (programs run in parallel). The
uniform forms (N sequences of T rows, sequence-major) can keep what a verify's rollback picks from:
states_out [N, T, Hv, dk, dv] and windows_out [N, C, K - 1 + T]. The varlen forms take cu_seqlens
[N + 1] (sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1]; a sequence may be shorter than K - 1,
its window then still holds part of the initial conv state). Slot values are not checked (that
would read the indices back from the GPU on every call, and break CUDA graph capture).

Under the interpreter a cast to bf16 truncates: outputs and the rounded beta / conv sum go through
triton_utils.round_to_format first, as the attention kernels' do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember.kernels.triton_utils import cast_constexprs, check_launch, interpret, next_pow2, round_to_format

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# State columns per GDN program: dk x 8 fp32 in one warp's registers (FLA's fused_recurrent choice),
# and dv / 8 programs per head, so even a batch-1 decode spreads over the SMs.
BLOCK_V = 8
BLOCK_C = 256  # conv channels per program


def applies(x: torch.Tensor) -> bool:
    """x (the step's activations) is a case for the kernels: fp32, bf16 or fp16, on a GPU (or anywhere
    under TRITON_INTERPRET=1)."""
    return (x.is_cuda or interpret()) and x.dtype in DTYPES


@triton.jit
def _extent(cu_ptr, n, T, UNIFORM: tl.constexpr):
    """(first row, end row) of sequence n: n T.. with uniform lengths, else from cu_seqlens."""
    if UNIFORM:
        bos = n.to(tl.int64) * T
        eos = bos + T
    else:
        bos = tl.load(cu_ptr + n).to(tl.int64)
        eos = tl.load(cu_ptr + n + 1).to(tl.int64)
    return bos, eos


@triton.jit
def _as_dtype(x, dtype: tl.constexpr, ROUND_MBITS: tl.constexpr, ROUND_MIN_NORMAL: tl.constexpr):
    """fp32 x rounded to dtype (round to nearest even, also under the interpreter; see round_to_format)."""
    return round_to_format(x, ROUND_MBITS, ROUND_MIN_NORMAL).to(dtype)


@triton.jit
def _below(idx, n, cond):
    """idx < n where the scalar cond holds, else all false: the condition is folded into the bound (the
    interpreter cannot & a scalar bool with a tensor)."""
    return idx < tl.where(cond, n, 0)


@triton.jit
def _softplus(x):
    """torch's F.softplus (threshold 20); log1p(e) as log(w) e / (w - 1), w = 1 + e (exact where e is tiny)."""
    e = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + e
    log1p = tl.where(w == 1.0, e, tl.log(w) * (e / tl.where(w == 1.0, 1.0, w - 1.0)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _l2norm(x, scale):
    """gated_delta_rule.l2norm, then the scale as a second rounding (prepare_qk's)."""
    return (x * tl.rsqrt(tl.sum(x * x, 0) + 1e-6)) * scale


@triton.jit
def _gdn_kernel(
    qkv_ptr,
    a_ptr,
    b_ptr,
    A_log_ptr,
    dt_bias_ptr,
    state_ptr,
    cu_ptr,
    src_ptr,
    dst_ptr,
    kept_ptr,
    o_ptr,
    T,
    stride_qkv,
    stride_a,
    stride_b,
    q_scale,
    HK: tl.constexpr,
    HV: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    DK_PAD: tl.constexpr,
    BV: tl.constexpr,
    UNIFORM: tl.constexpr,
    KEEP: tl.constexpr,
    ROUND_MBITS: tl.constexpr,
    ROUND_MIN_NORMAL: tl.constexpr,
):
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    hk = h // (HV // HK)
    bos, eos = _extent(cu_ptr, n, T, UNIFORM)
    i = tl.arange(0, DK_PAD)
    j = vb * BV + tl.arange(0, BV)
    i_ok, j_ok = i < DK, j < DV
    cell = i[:, None] * DV + j[None, :]  # this block's elements of one head's [dk, dv] state
    cell_ok = i_ok[:, None] & j_ok[None, :]
    src = tl.load(src_ptr + n).to(tl.int64)
    dst = tl.load(dst_ptr + n).to(tl.int64)
    head = (tl.maximum(src, 0) * HV + h) * (DK * DV)
    S = tl.load(state_ptr + head + cell, mask=_below(i, DK, src >= 0)[:, None] & j_ok[None, :], other=0.0)
    neg_A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    dt_bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    dtype = o_ptr.dtype.element_ty
    for t in range(bos, eos):
        row = qkv_ptr + t * stride_qkv
        q = _l2norm(tl.load(row + hk * DK + i, mask=i_ok, other=0.0).to(tl.float32), q_scale)
        k = _l2norm(tl.load(row + (HK + hk) * DK + i, mask=i_ok, other=0.0).to(tl.float32), 1.0)
        v = tl.load(row + 2 * HK * DK + h * DV + j, mask=j_ok, other=0.0).to(tl.float32)
        g = neg_A * _softplus(tl.load(a_ptr + t * stride_a + h).to(tl.float32) + dt_bias)
        beta = tl.sigmoid(tl.load(b_ptr + t * stride_b + h).to(tl.float32))
        beta = _as_dtype(beta, dtype, ROUND_MBITS, ROUND_MIN_NORMAL).to(tl.float32)  # as the layer's b.sigmoid()
        S = S * tl.exp(g)
        u = beta * (v - tl.sum(S * k[:, None], 0))
        S = S + k[:, None] * u[None, :]
        o = tl.sum(S * q[:, None], 0)
        tl.store(o_ptr + t * (HV * DV) + h * DV + j, _as_dtype(o, dtype, ROUND_MBITS, ROUND_MIN_NORMAL), mask=j_ok)
        if KEEP:  # rows are sequence-major, so row t is states_out[n, t - bos]
            tl.store(kept_ptr + (t * HV + h) * (DK * DV) + cell, S, mask=cell_ok)
    tl.store(
        state_ptr + (tl.maximum(dst, 0) * HV + h) * (DK * DV) + cell,
        S,
        mask=_below(i, DK, dst >= 0)[:, None] & j_ok[None, :],
    )


@triton.jit
def _conv_input(x_ptr, init_ptr, p, bos, stride_x, c, C, has_init, K: tl.constexpr):
    """Input p of the window (model dtype, [BC]): row p of x, or, before the sequence's first row, entry
    K - 1 + p - bos of its initial conv state (0 for a new sequence)."""
    from_x = p >= bos
    xv = tl.load(x_ptr + p * stride_x + c, mask=_below(c, C, from_x), other=0.0)
    sv = tl.load(init_ptr + c * (K - 1) + (K - 1 + p - bos), mask=_below(c, C, has_init & (p < bos)), other=0.0)
    return tl.where(from_x, xv, sv)


@triton.jit
def _conv_kernel(
    x_ptr,
    w_ptr,
    conv_ptr,
    cu_ptr,
    src_ptr,
    dst_ptr,
    win_ptr,
    out_ptr,
    T,
    C,
    stride_x,
    K: tl.constexpr,
    BC: tl.constexpr,
    UNIFORM: tl.constexpr,
    WINDOWS: tl.constexpr,
    ROUND_MBITS: tl.constexpr,
    ROUND_MIN_NORMAL: tl.constexpr,
):
    n, cb = tl.program_id(0), tl.program_id(1)
    bos, eos = _extent(cu_ptr, n, T, UNIFORM)
    c = cb * BC + tl.arange(0, BC)
    c_ok = c < C
    src = tl.load(src_ptr + n).to(tl.int64)
    dst = tl.load(dst_ptr + n).to(tl.int64)
    init = conv_ptr + tl.maximum(src, 0) * C * (K - 1)
    win = win_ptr + n.to(tl.int64) * C * (K - 1 + T) + c * (K - 1 + T)
    dtype = out_ptr.dtype.element_ty
    if WINDOWS:  # the window opens with the state before the step
        for jj in tl.static_range(K - 1):
            tl.store(win + jj, _conv_input(x_ptr, init, bos - (K - 1) + jj, bos, stride_x, c, C, src >= 0, K), c_ok)
    for t in range(bos, eos):
        acc = tl.zeros((BC,), tl.float32)
        for jj in tl.static_range(K):
            xj = _conv_input(x_ptr, init, t - (K - 1) + jj, bos, stride_x, c, C, src >= 0, K)
            acc += tl.load(w_ptr + c * K + jj, mask=c_ok, other=0.0).to(tl.float32) * xj.to(tl.float32)
            if WINDOWS:
                if jj == K - 1:  # the token's own input
                    tl.store(win + (K - 1) + (t - bos), xj, c_ok)
        pre = _as_dtype(acc, dtype, ROUND_MBITS, ROUND_MIN_NORMAL).to(tl.float32)  # the conv's output dtype
        y = pre / (1.0 + tl.exp(-pre))
        tl.store(out_ptr + t * C + c, _as_dtype(y, dtype, ROUND_MBITS, ROUND_MIN_NORMAL), mask=c_ok)
    # the K - 1 inputs before the next token, read (this thread's channels) after every read of src
    for jj in tl.static_range(K - 1):
        xj = _conv_input(x_ptr, init, eos - (K - 1) + jj, bos, stride_x, c, C, src >= 0, K)
        tl.store(conv_ptr + tl.maximum(dst, 0) * C * (K - 1) + c * (K - 1) + jj, xj, mask=_below(c, C, dst >= 0))


def _check_rows(what: str, rows: int, *tensors: torch.Tensor) -> None:
    for x in tensors:
        if x.dim() != 2 or x.shape[0] != rows or x.stride(1) != 1 or x.dtype != tensors[0].dtype:
            raise ValueError(f"{what} must share a dtype and be [{rows}, .] with contiguous rows")
    if tensors[0].dtype not in DTYPES:
        raise ValueError(f"{what}: float32, bf16 or fp16, not {tensors[0].dtype}")


def _check_slots(N: int, *idx: torch.Tensor) -> None:
    for x in idx:
        if x.dim() != 1 or x.numel() != N or x.dtype not in (torch.int32, torch.int64) or not x.is_contiguous():
            raise ValueError(f"slot / length indices must be contiguous int32 or int64 [{N}] tensors")


def _gdn(qkv, a, b, A_log, dt_bias, state, cu_seqlens, src_idx, dst_idx, T, states_out):
    """Both GDN forms: T rows per sequence (cu_seqlens None) or cu_seqlens's."""
    N = src_idx.numel()
    if state.dtype != torch.float32 or state.dim() != 4 or not state.is_contiguous():
        raise ValueError("state must be a contiguous float32 [slots, Hv, dk, dv] pool")
    Hv, dk, dv = state.shape[1:]
    rows, C = qkv.shape
    _check_rows("qkv, a and b", rows, qkv, a, b)
    Hk = (C - Hv * dv) // (2 * dk)
    if C <= Hv * dv or (C - Hv * dv) % (2 * dk) or Hv % Hk or a.shape[1] != Hv or b.shape[1] != Hv:
        raise ValueError(f"qkv [{rows}, {C}], a / b [., {a.shape[1]}] do not fit {Hv} value heads of {dk} x {dv}")
    _check_slots(N, src_idx, dst_idx)
    if A_log.shape != (Hv,) or dt_bias.shape != (Hv,) or not (A_log.is_contiguous() and dt_bias.is_contiguous()):
        raise ValueError("A_log and dt_bias must be contiguous [Hv] tensors")
    if states_out is not None and (
        states_out.dtype != torch.float32 or not states_out.is_contiguous() or states_out.shape != (N, T, Hv, dk, dv)
    ):
        raise ValueError(f"states_out must be a contiguous float32 {[N, T, Hv, dk, dv]}")
    check_launch(qkv, state)
    o = qkv.new_empty(rows, Hv * dv)
    if N == 0 or rows == 0:
        return o
    bv = min(BLOCK_V, next_pow2(dv))
    _gdn_kernel[(N, Hv, triton.cdiv(dv, bv))](
        qkv, a, b, A_log, dt_bias, state,
        cu_seqlens if cu_seqlens is not None else src_idx, src_idx, dst_idx,
        states_out if states_out is not None else state, o,
        T, qkv.stride(0), a.stride(0), b.stride(0), dk**-0.5,
        HK=Hk, HV=Hv, DK=dk, DV=dv, DK_PAD=next_pow2(dk), BV=bv,
        UNIFORM=cu_seqlens is None, KEEP=states_out is not None,
        **cast_constexprs(qkv.dtype, interpret()), num_warps=1,
    )  # fmt: skip
    return o


def _conv(x, weight, conv_state, cu_seqlens, src_idx, dst_idx, T, windows_out):
    """Both conv forms: T rows per sequence (cu_seqlens None) or cu_seqlens's."""
    N = src_idx.numel()
    rows, C = x.shape
    _check_rows("x", rows, x)
    K = weight.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != C or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{C}, K]")
    if conv_state.dim() != 3 or conv_state.shape[1:] != (C, K - 1) or not conv_state.is_contiguous():
        raise ValueError(f"conv_state must be a contiguous [slots, {C}, {K - 1}]")
    if weight.dtype != x.dtype or conv_state.dtype != x.dtype:
        raise ValueError("x, weight and conv_state must share a dtype")
    _check_slots(N, src_idx, dst_idx)
    if windows_out is not None and (
        windows_out.dtype != x.dtype or not windows_out.is_contiguous() or windows_out.shape != (N, C, K - 1 + T)
    ):
        raise ValueError(f"windows_out must be a contiguous {[N, C, K - 1 + T]} in x's dtype")
    check_launch(x, conv_state)
    out = x.new_empty(rows, C)
    if N == 0 or rows == 0:
        return out
    bc = min(BLOCK_C, next_pow2(C))
    _conv_kernel[(N, triton.cdiv(C, bc))](
        x, weight, conv_state, cu_seqlens if cu_seqlens is not None else src_idx, src_idx, dst_idx,
        windows_out if windows_out is not None else out, out,
        T, C, x.stride(0),
        K=K, BC=bc, UNIFORM=cu_seqlens is None, WINDOWS=windows_out is not None,
        **cast_constexprs(x.dtype, interpret()), num_warps=4,
    )  # fmt: skip
    return out


def _uniform_T(rows: int, src_idx: torch.Tensor) -> int:
    N = src_idx.numel()
    if N == 0 or rows % N:
        raise ValueError(f"{rows} rows are not N = len(src_idx) = {N} sequences of equal length")
    return rows // N


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
    in qkv's dtype."""
    T = _uniform_T(qkv.shape[0], src_idx)
    return _gdn(qkv, a, b, A_log, dt_bias, state, None, src_idx, dst_idx, T, states_out)


def gated_delta_net_varlen(
    qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
) -> torch.Tensor:
    """gated_delta_net over sequences of any lengths: sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1]
    of qkv, a, b (cu_seqlens [N + 1], int32 or int64, on the tensors' device)."""
    _check_slots(src_idx.numel() + 1, cu_seqlens)
    return _gdn(qkv, a, b, A_log, dt_bias, state, cu_seqlens, src_idx, dst_idx, 0, None)


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
    T = _uniform_T(x.shape[0], src_idx)
    return _conv(x, weight, conv_state, None, src_idx, dst_idx, T, windows_out)


def causal_conv1d_silu_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    cu_seqlens: torch.Tensor,
    src_idx: torch.Tensor,
    dst_idx: torch.Tensor,
) -> torch.Tensor:
    """causal_conv1d_silu over sequences of any lengths (cu_seqlens [N + 1], as gated_delta_net_varlen's):
    each sequence's conv state after its last row goes to its dst slot."""
    _check_slots(src_idx.numel() + 1, cu_seqlens)
    return _conv(x, weight, conv_state, cu_seqlens, src_idx, dst_idx, 0, None)
