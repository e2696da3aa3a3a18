"""The fused Gated DeltaNet CPU kernels (ember/kernels/cpu_gated_delta_net.*) against ember's torch
reference (ember/layers/gated_delta_rule.py, composed as GatedDeltaNet's decode and verify paths do):
grouped value heads (Hv > Hk), head dims that leave a vector tail, several slots in shuffled order
(a new sequence among them, a fork to another slot), float32 and bf16, verifies of 1-4 tokens with
the state after every token, 512 decode steps, tracing under torch.compile, bad input refused, and
the AVX2 build (-march=haswell) run through this module on an AVX-512 machine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.config.model_config import ModelConfig
from ember.kernels import cpp_build
from ember.kernels import cpu_gated_delta_net as gdn
from ember.kernels.cpu_kernels import CpuKernels
from ember.kernels.metadata import AttentionMetadata, RecurrentMetadata
from ember.layers import gated_delta_rule as gdr
from ember.layers.gated_deltanet import GatedDeltaNet
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(
    not (cpp_build.has_cpu_flags("avx512f") or cpp_build.has_cpu_flags("avx2", "fma")),
    reason="the Gated DeltaNet kernels need AVX-512 or AVX2 + FMA",
)

# (Hk, Hv, dk, dv): Qwen3.5-0.8B's heads; grouped heads with dims that leave a tail of 8 (AVX2) and 16
# lanes (AVX-512) and odd dk; one head of one vector; dk odd and dv below one vector
SHAPES = [(16, 16, 128, 128), (2, 6, 24, 40), (1, 1, 16, 16), (2, 4, 17, 5)]
SLOTS = 9
# sequences of the batch: (slot it starts from, slot it is written to): shuffled, a new sequence (-1)
# and a fork (3 -> 8)
SRC, DST = [5, 2, -1, 7, 3], [5, 2, 0, 7, 8]


def inputs(N, T, Hk, Hv, dk, dv, dtype, seed):
    """qkv [N*T, C] as a strided view (the conv output inside a wider row), a / b [N*T, Hv] as views of
    one [N*T, 2 Hv] projection output (as the layer's), A_log, dt_bias [Hv], a state pool."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * Hk * dk + Hv * dv
    qkv = torch.randn(N * T, C + 7, generator=g).to(dtype)[:, :C]
    ba = (torch.randn(N * T, 2 * Hv, generator=g) * 2).to(dtype)
    A_log = (torch.rand(Hv, generator=g) * 2 - 1).to(dtype)
    dt_bias = (torch.randn(Hv, generator=g) * 0.5).to(dtype)
    pool = torch.randn(SLOTS, Hv, dk, dv, generator=g) * 0.3
    return qkv, ba[:, Hv:], ba[:, :Hv], A_log, dt_bias, pool


def reference(qkv, a, b, A_log, dt_bias, pool, src, Hk, dk, T):
    """GatedDeltaNet's torch path: (o [N*T, Hv*dv] in qkv's dtype, the state after every token
    [N, T, Hv, dk, dv])."""
    N, Hv = len(src), A_log.shape[0]
    dv = pool.shape[-1]
    q, k, v = qkv.split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    q, k = gdr.prepare_qk(q.reshape(-1, Hk, dk), k.reshape(-1, Hk, dk), Hv)
    beta = b.sigmoid()
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    s0 = torch.stack([pool[s] if s >= 0 else torch.zeros_like(pool[0]) for s in src])

    def steps(x):  # [N*T, ...] -> [T, N, ...]: recurrent's token dim first, the sequences batched
        return x.reshape(N, T, *x.shape[1:]).transpose(0, 1)

    o, states = gdr.recurrent(steps(q), steps(k), steps(v.reshape(-1, Hv, dv)), steps(g), steps(beta), s0, True)
    return o.transpose(0, 1).reshape(N * T, Hv * dv).to(qkv.dtype), states.transpose(0, 1)


def assert_close_in(dtype, got, want):
    """float32: summation order only; bf16: one rounding of the output apart (a bf16 ulp is 2^-7 relative)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)


def idx(x):
    return torch.tensor(x, dtype=torch.int64)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_updates_each_slot_in_place(shape, dtype):
    Hk, Hv, dk, dv = shape
    assert gdn.available()
    qkv, a, b, A_log, dt_bias, pool = inputs(len(SRC), 1, *shape, dtype, seed=sum(shape))
    want_o, want_states = reference(qkv, a, b, A_log, dt_bias, pool, SRC, Hk, dk, 1)
    before = pool.clone()
    o = gdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool, idx(SRC), idx(DST))
    assert o.shape == (len(SRC), Hv * dv) and o.dtype == dtype
    assert_close_in(dtype, o, want_o)
    # the states are float32 from the same inputs: summation order apart, whatever the model's dtype
    torch.testing.assert_close(pool[DST], want_states[:, -1], rtol=1e-5, atol=1e-6)
    untouched = [s for s in range(SLOTS) if s not in DST]
    assert torch.equal(pool[untouched], before[untouched])  # slot 3, the fork's source, included


@pytest.mark.parametrize("T", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_keeps_the_state_after_every_token(T, dtype):
    Hk, Hv, dk, dv = shape = (2, 6, 24, 40)
    qkv, a, b, A_log, dt_bias, pool = inputs(len(SRC), T, *shape, dtype, seed=10 + T)
    want_o, want_states = reference(qkv, a, b, A_log, dt_bias, pool, SRC, Hk, dk, T)
    before = pool.clone()
    kept = torch.full((len(SRC), T, Hv, dk, dv), float("nan"))
    none = idx([-1] * len(SRC))  # a verify leaves its slots to the commit
    o = gdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool, idx(SRC), none, kept)
    assert_close_in(dtype, o, want_o)
    torch.testing.assert_close(kept, want_states, rtol=1e-5, atol=1e-6)
    assert torch.equal(pool, before)
    # rollback by index: the state after any accepted prefix is there; and with a dst, the last one
    pool2 = before.clone()
    gdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool2, idx(SRC), idx(DST), kept)
    assert torch.equal(pool2[DST], kept[:, -1])


def conv_inputs(N, T, C, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N * T, C + 5, generator=g).to(dtype)[:, :C]
    weight = (torch.randn(C, K, generator=g) * 0.5).to(dtype)
    pool = torch.randn(SLOTS, C, K - 1, generator=g).to(dtype)
    return x, weight, pool


@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("K", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_update_with_silu(T, K, dtype):
    C = 2 * 2 * 24 + 6 * 40 + 300  # past one 256-channel task, with a remainder
    x, weight, pool = conv_inputs(len(SRC), T, C, K, dtype, seed=T * K)
    before = pool.clone()
    windows = torch.empty(len(SRC), C, K - 1 + T, dtype=dtype)
    out = gdn.causal_conv1d_silu(x, weight, pool, idx(SRC), idx(DST), windows)
    for n, s in enumerate(SRC):  # each sequence through the layer's prefill / verify conv
        conv0 = pool.new_zeros(C, K - 1) if s < 0 else before[s]
        want, window = gdr.causal_conv(x[n * T : (n + 1) * T], conv0, weight)
        assert_close_in(dtype, out[n * T : (n + 1) * T], want)
        assert torch.equal(windows[n], window)
        assert torch.equal(pool[DST[n]], window[:, T : T + K - 1])
        if T == 1:  # and the decode path's step form, which rounds each product to the model's dtype
            step, state1 = gdr.causal_conv_step(x[n : n + 1], conv0[None], weight)
            assert torch.equal(pool[DST[n]], state1[0])
            if dtype == torch.float32:
                assert_close_in(dtype, out[n : n + 1], step)
            else:  # within those K roundings (2^-8 of each product) and the output's
                products = (torch.cat([conv0, x[n : n + 1].t()], dim=1).float() * weight.float()).abs().sum(-1)
                slack = (products + step[0].float().abs()) * 2**-7 + 1e-3
                assert bool(((out[n].float() - step[0].float()).abs() <= slack).all())
    untouched = [s for s in range(SLOTS) if s not in DST]
    assert torch.equal(pool[untouched], before[untouched])


def test_512_decode_steps_keep_the_state_within_1e4():
    """Qwen3.5-0.8B's heads, float32, two sequences: the state after 512 kernel steps against 512
    reference steps, relative Frobenius error <= 1e-4 (issue 40's bar), and every step's output."""
    Hk, Hv, dk, dv = 16, 16, 128, 128
    src = dst = [1, 0]
    g = torch.Generator().manual_seed(512)
    A_log = torch.rand(Hv, generator=g) * 2 - 1
    dt_bias = torch.randn(Hv, generator=g) * 0.5
    pool = torch.zeros(2, Hv, dk, dv)
    want = pool.clone()
    for step in range(512):
        qkv = torch.randn(2, 2 * Hk * dk + Hv * dv, generator=g)
        ba = torch.randn(2, 2 * Hv, generator=g) * 2
        o = gdn.gated_delta_net(qkv, ba[:, Hv:], ba[:, :Hv], A_log, dt_bias, pool, idx(src), idx(dst))
        want_o, states = reference(qkv, ba[:, Hv:], ba[:, :Hv], A_log, dt_bias, want, src, Hk, dk, 1)
        want[dst] = states[:, -1]
        torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-4)
    err = ((pool - want).norm() / want.norm()).item()
    print(f"relative state error after 512 decode steps: {err:.2e}")
    assert err <= 1e-4


def test_conv_then_gdn_traced_by_torch_compile():
    """Both ops have fake kernels and declare the pools they write: a compiled graph calls them with no
    graph break, and the writes reach the pools as in eager mode."""
    Hk, Hv, dk, dv = shape = (2, 4, 16, 24)
    C, K = 2 * Hk * dk + Hv * dv, 4
    qkv, a, b, A_log, dt_bias, ssm = inputs(3, 1, *shape, torch.float32, seed=3)
    x, weight, conv = conv_inputs(3, 1, C, K, torch.float32, seed=4)
    src, dst = idx([4, -1, 6]), idx([4, 1, 6])

    def step(x, conv, ssm):
        mixed = gdn.causal_conv1d_silu(x, weight, conv, src, dst)
        return gdn.gated_delta_net(mixed, a, b, A_log, dt_bias, ssm, src, dst)

    conv_e, ssm_e = conv.clone(), ssm.clone()
    want = step(x, conv_e, ssm_e)
    got = torch.compile(step, fullgraph=True)(x, conv, ssm)
    assert torch.equal(got, want) and torch.equal(conv, conv_e) and torch.equal(ssm, ssm_e)


def test_bad_inputs_are_refused_with_a_message():
    qkv, a, b, A_log, dt_bias, pool = inputs(2, 1, 2, 4, 16, 16, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="not -1 or a slot"):
        gdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool, idx([0, SLOTS]), idx([0, 1]))
    with pytest.raises(RuntimeError, match="float32"):
        gdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool.double(), idx([0, 1]), idx([0, 1]))
    with pytest.raises(RuntimeError, match="multiple of Hk"):  # 2 key heads' worth of channels for 3 value heads
        three = pool[:, :3].contiguous()
        gdn.gated_delta_net(qkv[:, :112], a[:, :3], b[:, :3], A_log[:3], dt_bias[:3], three, idx([0, 1]), idx([0, 1]))
    with pytest.raises(RuntimeError, match="states_out"):
        gdn.gated_delta_net(qkv, a, b, A_log, dt_bias, pool, idx([0, 1]), idx([0, 1]), torch.empty(2, 1, 4, 16, 8))


def step(query_lens, slots, has, drafts, snapshots):
    """A step's metadata as far as a Gated DeltaNet layer reads it."""
    B, T = len(query_lens), sum(query_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(T, dtype=torch.int64),
        query_start_loc=torch.zeros(B + 1, dtype=torch.int32),
        seq_lens=torch.ones(B, dtype=torch.int32),
        block_tables=torch.zeros(B, 1, dtype=torch.int32),
        block_size=4,
        query_lens_cpu=query_lens,
        seq_lens_cpu=[1] * B,
        max_query_len=max(query_lens),
        max_seq_len=1,
        recurrent=RecurrentMetadata(slots, has, drafts, snapshots),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_takes_the_kernels_and_matches_its_torch_path(dtype, tiny_hybrid_dir, monkeypatch):
    """GatedDeltaNet with the kernels (the default) against CpuKernels.none(), same weights and states:
    a step mixing decodes (one of them a new sequence, one with a snapshot), verifies (with a
    snapshot) and a prefill (a new sequence, with snapshots inside: one whose conv window reaches
    into the slot's, one past it), the commit after it, then a step of decodes only. Tiny Qwen3.5 heads
    (2 key, 4 value, dk 12, dv 10)."""
    cfg = ModelConfig.from_folder(tiny_hybrid_dir("qwen3_5"))
    torch.manual_seed(0)
    fused, ref = GatedDeltaNet(cfg, dtype, "cpu"), GatedDeltaNet(cfg, dtype, "cpu", kernels=CpuKernels.none())
    with torch.no_grad():
        for p in fused.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    ref.load_state_dict(fused.state_dict())
    states = fused.make_state(9, "cpu")
    states.conv.normal_()
    states.ssm.normal_()
    ref_states = ref.make_state(9, "cpu")
    ref_states.conv.copy_(states.conv)
    ref_states.ssm.copy_(states.ssm)
    calls, op = [], gdn.gated_delta_net

    def counted(*args):  # whether each call kept every token's state (a verify)
        calls.append(len(args) > 8 and args[8] is not None)
        return op(*args)

    monkeypatch.setattr(gdn, "gated_delta_net", counted)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.03, atol=0.03)
    mixed = step([1, 4, 5, 1, 2], [3, 1, 5, 0, 2], [True, True, False, False, True], [0, 3, 0, 0, 1],
                 [[], [], [(2, 4), (4, 8)], [(1, 6)], [(1, 7)]])  # fmt: skip
    decodes = step([1] * 5, [1, 2, 3, 0, 5], [True] * 5, [0] * 5, [[]] * 5)
    for meta, accepted in [(mixed, {1: 2, 2: 0}), (decodes, None)]:
        x = torch.randn(sum(meta.query_lens_cpu), cfg.hidden_size).to(dtype)
        with torch.inference_mode():
            torch.testing.assert_close(fused(x, states, meta).float(), ref(x, ref_states, meta).float(), **tol)
        if accepted:
            states.commit(accepted)
            ref_states.commit(accepted)
        torch.testing.assert_close(states.ssm, ref_states.ssm, **tol)
        torch.testing.assert_close(states.conv.float(), ref_states.conv.float(), **tol)
    # a verify, the prefill's three pieces (cut at its snapshots), the other verify, the decodes; then the decodes
    assert calls == [True, False, False, False, True, False, False]


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine has AVX-512 the kernel is its 16-lane build; the 8-lane AVX2 + FMA build
    (Zen2/3, Haswell on) is compiled here with -march=haswell under the name this machine looks for,
    in a kernel dir of its own, and this module's other tests run against it in a child process."""
    if not cpp_build.has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build(gdn.SOURCE, also=("cpu_fused_elementwise.cpp",))  # the gated norm its layer tests run
    lanes = "import torch; from ember.kernels import cpu_gated_delta_net as g; g.available(); "
    lanes += "print(torch.ops.ember_cpu.gated_delta_net_lanes())"
    said, run = avx2_child.probe_and_run(env, lanes, __file__, masked=False)
    assert said == ["8"]
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
