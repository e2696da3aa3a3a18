"""The gated delta rule (Gated DeltaNet's recurrence) and its causal conv, in torch: the reference
the fast CPU / GPU kernels are checked against.

Per value head, with the state S [dk, dv] in float32, one token does

    S <- exp(g) * S;   u = beta * (v - S^T k);   S <- S + k u^T;   o = S^T q

(q and k L2-normalised, q scaled by dk^-0.5; g <= 0 is the log decay, beta in (0, 1)).

`chunked` runs a prompt 64 tokens at a time in the WY form: inside a chunk with cumulative log
decay G_i = g_1 + ... + g_i, the updates U (rows u_i) solve a unit lower-triangular system

    (I + A) U = beta V - (beta e^G K) S0,   A_ij = beta_i e^(G_i - G_j) k_i.k_j  (j < i)

and then O = (e^G Q) S0 + (M * Q K^T) U with M_ij = e^(G_i - G_j) (j <= i), and the state leaves
the chunk as e^(G_c) S0 + (e^(G_c - G) K)^T U. Every exponent is <= 0: nothing overflows.
`recurrent` runs token by token and can keep the state after each token (a speculative verify
needs the state at whichever draft is the last accepted).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in float32 (the eps of the reference kernels)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def prepare_qk(q: torch.Tensor, k: torch.Tensor, num_value_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., nk, dk] -> float32 [..., nv, dk]: L2-normalised, q scaled by dk^-0.5, each key
    head repeated for the nv / nk value heads that read it (value head j reads key head j // r)."""
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    r = num_value_heads // q.shape[-2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
    return q, k


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence. q, k [L, H, dk], v [L, H, dv], g, beta [L, H] float32 (q, k prepared);
    state [H, dk, dv] float32 (the state before the first token). Returns (o [L, H, dv], final state)."""
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.float().transpose(0, 1)  # [H, L, .]
    g, beta = g.float().t(), beta.float().t()  # [H, L]
    outs = []
    for s in range(0, q.shape[1], chunk):
        e = min(s + chunk, q.shape[1])
        o, state = _chunk(q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], state)
        outs.append(o)
    return torch.cat(outs, dim=1).transpose(0, 1), state


def _chunk(q, k, v, g, beta, s0):
    """One chunk, heads batched: q, k [H, c, dk], v [H, c, dv], g, beta [H, c], s0 [H, dk, dv]."""
    c = q.shape[1]
    G = g.cumsum(-1)
    diff = G[:, :, None] - G[:, None, :]  # G_i - G_j
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = torch.where(lower, diff, float("-inf")).exp()  # M: e^(G_i - G_j) for j <= i, else 0
    a = (beta[:, :, None] * decay * (k @ k.transpose(1, 2))).tril(-1)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    eg = G.exp()[:, :, None]
    rhs = torch.cat([beta[:, :, None] * v, beta[:, :, None] * eg * k], dim=-1)
    w = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    w_v, w_k = w.split([v.shape[-1], k.shape[-1]], dim=-1)
    u = w_v - w_k @ s0
    o = (q * eg) @ s0 + (decay * (q @ k.transpose(1, 2))) @ u
    tail = (G[:, -1:] - G).exp()[:, :, None]  # e^(G_c - G_j)
    s1 = G[:, -1].exp()[:, None, None] * s0 + (k * tail).transpose(1, 2) @ u
    return o, s1


def recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token over dim 0, any batch dims after it. q, k [L, ..., dk], v [L, ..., dv],
    g, beta [L, ...]; state [..., dk, dv] float32. Returns (o [L, ..., dv] float32, the final state
    [..., dk, dv] or, with keep_states, every token's state [L, ..., dk, dv])."""
    outs, states = [], []
    for t in range(q.shape[0]):
        state = state * g[t].float().exp()[..., None, None]
        kt = k[t].float()
        u = beta[t].float()[..., None] * (v[t].float() - (state * kt[..., None]).sum(-2))
        state = state + kt[..., :, None] * u[..., None, :]
        outs.append((state * q[t].float()[..., None]).sum(-2))
        if keep_states:
            states.append(state)
    return torch.stack(outs), torch.stack(states) if keep_states else state


def causal_conv(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's depthwise causal conv + SiLU. x [L, C]; conv_state [C, K - 1] (the K - 1 inputs
    before x; zeros for a new sequence); weight [C, K]. Returns (out [L, C], window [C, K - 1 + L]):
    the state after token t is window[:, t + 1 : t + K]."""
    window = torch.cat([conv_state.to(x.dtype), x.t()], dim=1)
    out = F.conv1d(window[None].to(weight.dtype), weight[:, None, :], groups=weight.shape[0])[0]
    return F.silu(out).t().to(x.dtype), window


def causal_conv_step(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of B sequences. x [B, C]; conv_state [B, C, K - 1]. Returns (out [B, C],
    the new conv states [B, C, K - 1])."""
    window = torch.cat([conv_state.to(x.dtype), x[:, :, None]], dim=2)  # [B, C, K]
    out = (window.to(weight.dtype) * weight).sum(-1)
    return F.silu(out).to(x.dtype), window[:, :, 1:]
