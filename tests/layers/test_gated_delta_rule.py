"""The gated delta rule and its conv against transformers' torch reference (Qwen3-Next's
torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule): outputs and final state within
1e-5, for lengths that are not multiples of the 64-token chunk, one token, and a nonzero state."""

import pytest
import torch
import torch.nn.functional as F

from ember.layers import gated_delta_rule as gdr

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

NK, NV, DK, DV = 2, 6, 12, 20  # 3 value heads per key head; dk != dv, neither a power of two


def _inputs(L, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, NK, DK, generator=g)
    k = torch.randn(L, NK, DK, generator=g)
    v = torch.randn(L, NV, DV, generator=g)
    # decays as the model makes them: -exp(A_log) * softplus(a + dt_bias)
    gate = -torch.rand(NV, generator=g).mul(3).exp() * F.softplus(torch.randn(L, NV, generator=g))
    beta = torch.rand(L, NV, generator=g)
    state = torch.randn(NV, DK, DV, generator=g) * 0.5
    return q, k, v, gate, beta, state


def _hf(q, k, v, gate, beta, state, chunk=True):
    fn = hf.torch_chunk_gated_delta_rule if chunk else hf.torch_recurrent_gated_delta_rule
    o, s = fn(
        q[None],
        k[None],
        v[None],
        g=gate[None],
        beta=beta[None],
        initial_state=state[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0], s[0]


@pytest.mark.parametrize("L", [1, 7, 63, 64, 65, 130])
@pytest.mark.parametrize("zero_state", [False, True])
def test_chunked_matches_reference(L, zero_state):
    q, k, v, gate, beta, state = _inputs(L, seed=L)
    if zero_state:
        state = torch.zeros_like(state)
    want_o, want_s = _hf(q, k, v, gate, beta, state)
    qe, ke = gdr.prepare_qk(q, k, NV)
    o, s = gdr.chunked(qe, ke, v, gate, beta, state)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("L", [1, 5])
def test_recurrent_matches_reference_and_keeps_every_state(L):
    q, k, v, gate, beta, state = _inputs(L, seed=100 + L)
    want_o, want_s = _hf(q, k, v, gate, beta, state, chunk=False)
    qe, ke = gdr.prepare_qk(q, k, NV)
    o, states = gdr.recurrent(qe, ke, v, gate, beta, state, keep_states=True)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states[-1], want_s, rtol=1e-5, atol=1e-5)
    for t in range(L):  # the state after token t is the final state of the first t + 1 tokens
        _, s_t = _hf(q[: t + 1], k[: t + 1], v[: t + 1], gate[: t + 1], beta[: t + 1], state, chunk=False)
        torch.testing.assert_close(states[t], s_t, rtol=1e-5, atol=1e-5)


def test_chunks_compose_like_one_pass():
    """A prompt split anywhere (chunked prefill) continues from the state the first part left."""
    q, k, v, gate, beta, state = _inputs(150, seed=7)
    qe, ke = gdr.prepare_qk(q, k, NV)
    o, s = gdr.chunked(qe, ke, v, gate, beta, state)
    o1, s1 = gdr.chunked(qe[:37], ke[:37], v[:37], gate[:37], beta[:37], state)
    o2, s2 = gdr.chunked(qe[37:], ke[37:], v[37:], gate[37:], beta[37:], s1)
    torch.testing.assert_close(torch.cat([o1, o2]), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s, rtol=1e-5, atol=1e-5)


def test_causal_conv_matches_reference_and_continues():
    C, K, L = 10, 4, 9
    g = torch.Generator().manual_seed(3)
    x = torch.randn(L, C, generator=g)
    w = torch.randn(C, K, generator=g)
    want = hf.causal_conv1d_fn(x.t()[None], w, None, activation="silu")[0].t()
    out, window = gdr.causal_conv(x, torch.zeros(C, K - 1), w)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    # split after 5 tokens: the window's state continues the conv; then one token at a time
    out1, win1 = gdr.causal_conv(x[:5], torch.zeros(C, K - 1), w)
    state = win1[:, -(K - 1) :]
    out2, _ = gdr.causal_conv(x[5:7], state, w)
    state = torch.cat([state, x[5:7].t()], dim=1)[:, -(K - 1) :]
    steps = []
    for t in (7, 8):
        o, state = gdr.causal_conv_step(x[t : t + 1], state[None], w)
        state = state[0]
        steps.append(o)
    torch.testing.assert_close(torch.cat([out1, out2, *steps]), want, rtol=1e-6, atol=1e-6)
    # the window keeps every token's state: after token t (here t = 2) it is window[:, t + 1 : t + K]
    padded = torch.cat([torch.zeros(C, K - 1), x.t()], dim=1)
    torch.testing.assert_close(window[:, 3 : 3 + K - 1], padded[:, 3 : 3 + K - 1])
