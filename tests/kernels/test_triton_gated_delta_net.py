"""The Triton Gated DeltaNet kernels (ember/kernels/triton_gated_delta_net.py) against ember's torch
reference (ember/layers/gated_delta_rule.py, composed as GatedDeltaNet's paths do): decodes and
verifies in the CPU ops' interface, and varlen prefills of sequences of different lengths each from
its own slot. Grouped value heads (Hv > Hk), head dims that are not powers of two (masked) and ones
that are, several slots in shuffled order with a new sequence (-1), a fork to another slot and a
sequence whose state is not written, float32 and bf16.

Without a GPU these run in Triton's interpreter on CPU tensors (tests/kernels/conftest.py sets
TRITON_INTERPRET=1 before triton is imported); under it a cast to bf16 goes through
round_to_format first, so bf16 cases check that path, not the GPU's cast. Shapes are tiny: the
interpreter runs programs one by one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ember.kernels import triton_gated_delta_net as tgdn  # noqa: E402
from ember.layers import gated_delta_rule as gdr  # noqa: E402
from tests.models.tiny_models import one_thread  # noqa: E402

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (Hk, Hv, dk, dv): grouped heads with masked dk and dv (dv 20: blocks of 8, 8 and 4 columns); one
# head of powers of two
SHAPES = [(2, 4, 12, 20), (1, 1, 16, 16)]
VARLEN_SHAPE = (1, 2, 20, 12)
SLOTS = 7
# sequences: (slot it starts from, slot it is written to): shuffled, a new sequence (-1), a fork
# (3 -> 6) and one whose state is not written (dst -1)
SRC, DST = [5, -1, 3, 1], [5, 0, 6, -1]
K = 4


def idx(x):
    return torch.tensor(x, dtype=torch.int64, device=DEVICE)


def gdn_inputs(rows, Hk, Hv, dk, dv, dtype, seed):
    """qkv [rows, C] as a strided view (inside a wider row), a / b [rows, Hv] as views of one [rows, 2 Hv]
    projection output (as the layer's), A_log, dt_bias [Hv], a state pool of nonzero states."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    qkv = torch.randn(rows, C + 7, generator=g).to(dtype)[:, :C]
    ba = (torch.randn(rows, 2 * Hv, generator=g) * 2).to(dtype)
    A_log = (torch.rand(Hv, generator=g) * 2 - 1).to(dtype)
    dt_bias = (torch.randn(Hv, generator=g) * 0.5).to(dtype)
    pool = torch.randn(SLOTS, Hv, dk, dv, generator=g) * 0.3
    return [t.to(DEVICE) for t in (qkv, ba[:, Hv:], ba[:, :Hv], A_log, dt_bias, pool)]


def gdn_reference(qkv, a, b, A_log, dt_bias, pool, src, lens, Hk, dk):
    """GatedDeltaNet's torch path, one sequence at a time: (o [rows, Hv*dv] in qkv's dtype, each
    sequence's state after every token [L, Hv, dk, dv])."""
    Hv, dv = A_log.shape[0], pool.shape[-1]
    q, k, v = qkv.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k = gdr.prepare_qk(q.reshape(-1, Hk, dk), k.reshape(-1, Hk, dk), Hv)
    v = v.reshape(-1, Hv, dv)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    outs, states, s = [], [], 0
    for slot, n in zip(src, lens):
        r = slice(s, s + n)
        s0 = pool[slot] if slot >= 0 else torch.zeros_like(pool[0])
        o, st = gdr.recurrent(q[r], k[r], v[r], g[r], beta[r], s0, keep_states=True)
        outs.append(o.reshape(n, Hv * dv))
        states.append(st)
        s += n
    return torch.cat(outs).to(qkv.dtype), states


def conv_inputs(rows, C, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, C + 5, generator=g).to(dtype)[:, :C]
    weight = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    pool = torch.randn(SLOTS, C, K - 1, generator=g).to(dtype)
    return x.to(DEVICE), weight.to(DEVICE), pool.to(DEVICE)


def conv_reference(x, weight, pool, src, lens):
    """gdr.causal_conv per sequence: (out [rows, C], each sequence's window [C, K - 1 + L])."""
    outs, windows, s = [], [], 0
    for slot, n in zip(src, lens):
        conv0 = pool[slot] if slot >= 0 else pool.new_zeros(pool.shape[1:])
        out, window = gdr.causal_conv(x[s : s + n], conv0, weight)
        outs.append(out)
        windows.append(window)
        s += n
    return torch.cat(outs), windows


def assert_close_in(dtype, got, want):
    """float32: summation order only; bf16: one rounding of the output apart (a bf16 ulp is 2^-7 relative)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def assert_untouched(pool, before, dst):
    untouched = [s for s in range(SLOTS) if s not in dst]
    assert torch.equal(pool[untouched], before[untouched])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_updates_each_slot_in_place(shape, dtype):
    Hk, Hv, dk, dv = shape
    N = len(SRC)
    qkv, a, b, A_log, dt_bias, pool = gdn_inputs(N, *shape, dtype, seed=sum(shape))
    want_o, want_states = gdn_reference(qkv, a, b, A_log, dt_bias, pool, SRC, [1] * N, Hk, dk)
    before = pool.clone()
    o = tgdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool, idx(SRC), idx(DST))
    assert o.shape == (N, Hv * dv) and o.dtype == dtype
    assert_close_in(dtype, o, want_o)
    for n, d in enumerate(DST):  # the states are float32 from the same inputs, whatever the model's dtype
        if d >= 0:
            torch.testing.assert_close(pool[d], want_states[n][-1], rtol=1e-5, atol=1e-6)
    assert_untouched(pool, before, DST)  # slot 3 (the fork's source) and 1 (dst -1) included


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_keeps_the_state_after_every_token(dtype):
    """3 tokens a sequence, every token's state kept; the last one also lands in the dst slot, where
    there is one (the layer's verify passes -1 for all: sequence 3 is that case)."""
    Hk, Hv, dk, dv = shape = SHAPES[0]
    N, T = len(SRC), 3
    qkv, a, b, A_log, dt_bias, pool = gdn_inputs(N * T, *shape, dtype, seed=11)
    want_o, want_states = gdn_reference(qkv, a, b, A_log, dt_bias, pool, SRC, [T] * N, Hk, dk)
    before = pool.clone()
    kept = torch.full((N, T, Hv, dk, dv), float("nan"), device=DEVICE)
    o = tgdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool, idx(SRC), idx(DST), kept)
    assert_close_in(dtype, o, want_o)
    torch.testing.assert_close(kept, torch.stack(want_states), rtol=1e-5, atol=1e-6)
    written = [n for n, d in enumerate(DST) if d >= 0]
    assert torch.equal(pool[[DST[n] for n in written]], kept[written, -1])
    assert_untouched(pool, before, DST)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_with_silu(T, dtype):
    C = 2 * 2 * 12 + 4 * 20 + 3  # odd: the last channel block masked
    N = len(SRC)
    x, weight, pool = conv_inputs(N * T, C, dtype, seed=T)
    want, want_windows = conv_reference(x, weight, pool, SRC, [T] * N)
    before = pool.clone()
    windows = torch.empty(N, C, K - 1 + T, dtype=dtype, device=DEVICE)
    out = tgdn.causal_conv1d_silu(x, weight, pool, idx(SRC), idx(DST), windows)
    assert out.shape == (N * T, C) and out.dtype == dtype
    assert_close_in(dtype, out, want)
    for n, d in enumerate(DST):
        assert torch.equal(windows[n], want_windows[n])
        if d >= 0:
            assert torch.equal(pool[d], want_windows[n][:, T : T + K - 1])
    assert_untouched(pool, before, DST)


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)])
def test_varlen_prefill_from_each_slot(dtype):
    """Prompts of 1, 5 and 70 tokens in one launch, from nonzero states (one a new sequence): the
    1-token one's conv window still holds part of its initial state; 70 crosses the chunked form's 64.
    Heads (1, 2, 20, 12): grouped, dk masked, two column blocks (the interpreter's time is per token)."""
    Hk, Hv, dk, dv = shape = VARLEN_SHAPE
    lens, src, dst = [1, 5, 70], [2, -1, 4], [2, 5, 0]
    cu = idx([0, 1, 6, 76])
    C = 2 * Hk * dk + Hv * dv
    x, weight, conv = conv_inputs(sum(lens), C, dtype, seed=5)
    want, windows = conv_reference(x, weight, conv, src, lens)
    conv_before = conv.clone()
    out = tgdn.causal_conv1d_silu_varlen(x, weight, conv, cu, idx(src), idx(dst))
    assert_close_in(dtype, out, want)
    for n, d in enumerate(dst):
        assert torch.equal(conv[d], windows[n][:, lens[n] : lens[n] + K - 1])
    assert_untouched(conv, conv_before, dst)

    qkv, a, b, A_log, dt_bias, pool = gdn_inputs(sum(lens), *shape, dtype, seed=6)
    want_o, want_states = gdn_reference(qkv, a, b, A_log, dt_bias, pool, src, lens, Hk, dk)
    before = pool.clone()
    o = tgdn.gated_delta_net_varlen(qkv, a, b, A_log, dt_bias, pool, cu.int(), idx(src), idx(dst))
    assert_close_in(dtype, o, want_o)
    for n, d in enumerate(dst):
        torch.testing.assert_close(pool[d], want_states[n][-1], rtol=1e-5, atol=1e-5)
    assert_untouched(pool, before, dst)
    if dtype == torch.float32:  # and the layer's prefill form, the chunked one, agrees over 70 tokens
        q, k, v = qkv[6:].split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q, k = gdr.prepare_qk(q.reshape(-1, Hk, dk), k.reshape(-1, Hk, dk), Hv)
        g = -A_log.exp() * F.softplus(a[6:] + dt_bias)
        _, final = gdr.chunked(q, k, v.reshape(-1, Hv, dv), g, b[6:].sigmoid(), before[4])
        torch.testing.assert_close(pool[0], final, rtol=1e-4, atol=1e-4)


def test_prefill_leaves_the_state_of_as_many_decodes():
    """Two sequences of 5 tokens: one varlen prefill against 5 decode steps, conv and SSM state."""
    Hk, Hv, dk, dv = shape = VARLEN_SHAPE
    L, slots = 5, [3, 1]
    cu = idx([0, L, 2 * L])
    C = 2 * Hk * dk + Hv * dv
    x, weight, conv = conv_inputs(2 * L, C, torch.float32, seed=7)
    qkv, a, b, A_log, dt_bias, pool = gdn_inputs(2 * L, *shape, torch.float32, seed=8)
    conv2, pool2 = conv.clone(), pool.clone()
    out = tgdn.causal_conv1d_silu_varlen(x, weight, conv, cu, idx(slots), idx(slots))
    o = tgdn.gated_delta_net_varlen(qkv, a, b, A_log, dt_bias, pool, cu, idx(slots), idx(slots))
    for t in range(L):
        rows = [t, L + t]
        out_t = tgdn.causal_conv1d_silu(x[rows], weight, conv2, idx(slots), idx(slots))
        o_t = tgdn.gated_delta_net(qkv[rows], a[rows], b[rows], A_log, dt_bias, pool2, idx(slots), idx(slots))
        torch.testing.assert_close(out_t, out[rows], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(o_t, o[rows], rtol=1e-6, atol=1e-6)
    assert torch.equal(conv2, conv)
    torch.testing.assert_close(pool2, pool, rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_refused_with_a_message():
    qkv, a, b, A_log, dt_bias, pool = gdn_inputs(2, *SHAPES[0], torch.float32, seed=0)
    src = idx([0, 1])
    with pytest.raises(ValueError, match="states_out"):
        tgdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool, src, src, torch.empty(2, 1, 4, 12, 8))
    with pytest.raises(ValueError, match="do not fit"):
        tgdn.gated_delta_net(qkv[:, :-1], a, b, A_log, dt_bias, pool, src, src)
    with pytest.raises(ValueError, match="float32"):
        tgdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool.double(), src, src)
    with pytest.raises(ValueError, match="equal length"):
        tgdn.gated_delta_net(qkv[:1], a[:1], b[:1], A_log, dt_bias, pool, src, src)
    x, weight, conv = conv_inputs(2, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="conv_state"):
        tgdn.causal_conv1d_silu(x, weight, conv[:, :, :2], src, src)
    with pytest.raises(ValueError, match="int32 or int64"):
        tgdn.causal_conv1d_silu_varlen(x, weight, conv, idx([0, 2]), src, src)


def test_applies_to_float_activations_where_triton_runs():
    assert tgdn.applies(torch.empty(1, device=DEVICE, dtype=torch.bfloat16))
    assert not tgdn.applies(torch.empty(1, device=DEVICE, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_on_a_gpu_takes_the_kernels_and_matches_its_torch_path(dtype, tiny_hybrid_dir, monkeypatch):
    """GatedDeltaNet as it runs on a GPU (the Triton kernels, here under the interpreter) against its
    torch path, same weights and states: a step mixing decodes (one a new sequence, one with a
    snapshot), verifies (with a snapshot), a new prompt with a snapshot inside it and one from its
    slot, the commit after it, then a step of decodes only. fla-core is not installed in the tests, so
    prefills take the Triton kernel token by token."""
    from ember.config.model_config import ModelConfig
    from ember.kernels.cpu_kernels import CpuKernels
    from ember.layers.gated_deltanet import GatedDeltaNet
    from tests.kernels.test_cpu_gated_delta_net import step

    cfg = ModelConfig.from_folder(tiny_hybrid_dir("qwen3_5"))
    torch.manual_seed(0)
    ref = GatedDeltaNet(cfg, dtype, DEVICE, kernels=CpuKernels.none())
    fused = GatedDeltaNet(cfg, dtype, DEVICE, kernels=CpuKernels.none())
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    fused.load_state_dict(ref.state_dict())
    monkeypatch.setattr(fused, "_kernels", lambda mixed, state: tgdn)  # what a CUDA step picks
    monkeypatch.setattr(ref, "_kernels", lambda mixed, state: None)  # the torch path, on a GPU too
    states, ref_states = fused.make_state(9, DEVICE), ref.make_state(9, DEVICE)
    states.conv.normal_()
    states.ssm.normal_()
    ref_states.conv.copy_(states.conv)
    ref_states.ssm.copy_(states.ssm)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.03, atol=0.03)
    mixed = step([1, 4, 6, 1, 2, 3], [3, 1, 5, 0, 2, 4], [True, True, False, False, True, True], [0, 3, 0, 0, 1, 0],
                 [[], [], [(4, 8)], [(1, 6)], [(1, 7)], []])  # fmt: skip
    decodes = step([1] * 6, [1, 2, 3, 0, 5, 4], [True] * 6, [0] * 6, [[]] * 6)
    for meta, accepted in [(mixed, {1: 2, 2: 0}), (decodes, None)]:
        x = torch.randn(sum(meta.query_lens_cpu), cfg.hidden_size).to(DEVICE, dtype)
        with torch.inference_mode():
            torch.testing.assert_close(fused(x, states, meta).float(), ref(x, ref_states, meta).float(), **tol)
        if accepted:
            states.commit(accepted)
            ref_states.commit(accepted)
        torch.testing.assert_close(states.ssm, ref_states.ssm, **tol)
        torch.testing.assert_close(states.conv.float(), ref_states.conv.float(), **tol)
