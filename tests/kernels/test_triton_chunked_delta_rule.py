"""fla-core's chunked gated delta rule through ember.kernels.triton_chunked_delta_rule, against ember's
torch reference (gated_delta_rule.chunked, one sequence at a time).

fla is an optional GPU dependency: without it the file skips. Without a GPU the kernels run under
Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by conftest.py), about 2.5 s a call at
these sizes. On a GPU fla's fp32 dots run in tf32, hence the looser tolerance there; bf16 is not
testable under the interpreter (tl.dot multiplies its raw bits), so it is checked on a GPU only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core (the optional GPU extra) is not installed")

from ember.kernels import triton_chunked_delta_rule as tcd  # noqa: E402
from ember.layers import gated_delta_rule as gdr  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5 if DEVICE == "cpu" else 5e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}


def make_step(lens, hk, hv, dk, dv, slots, dtype=torch.float32, seed=0):
    """A packed step: raw q, k (as the conv gives them), v, g, beta, and a pool of random states."""
    torch.manual_seed(seed)
    T = sum(lens)
    q, k = torch.randn(T, hk, dk) * 2, torch.randn(T, hk, dk)
    v = torch.randn(T, hv, dv)
    g = -F.softplus(torch.randn(T, hv)) * 0.5  # log decay <= 0
    beta = torch.rand(T, hv)
    pool = torch.randn(slots, hv, dk, dv) * 0.3
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    q, k, v, beta = (x.to(dtype) for x in (q, k, v, beta))
    return q, k, v, g, beta, pool, cu


def reference(q, k, v, g, beta, pool, cu, src, dst):
    """gated_delta_rule.chunked per sequence: (o [T, Hv, dv] float32, the pool after the step)."""
    qp, kp = gdr.prepare_qk(q.float(), k.float(), v.shape[1])
    pool, outs = pool.clone(), []
    finals = []
    for n in range(len(cu) - 1):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        s0 = pool[src[n]] if src[n] >= 0 else torch.zeros_like(pool[0])
        o, s1 = gdr.chunked(qp[rows], kp[rows], v[rows].float(), g[rows], beta[rows].float(), s0)
        outs.append(o)
        finals.append(s1)
    for n, s1 in enumerate(finals):
        pool[dst[n]] = s1
    return torch.cat(outs), pool


def run(q, k, v, g, beta, pool, cu, src, dst, qk_normalized=False):
    dev = lambda x: x.to(DEVICE)  # noqa: E731
    state = pool.clone().to(DEVICE)  # the pool is updated in place: keep the caller's
    o = tcd.chunked_prefill(
        dev(q),
        dev(k),
        dev(v),
        dev(g),
        dev(beta),
        state,
        dev(cu),
        dev(torch.tensor(src)),
        dev(torch.tensor(dst)),
        cu_seqlens_cpu=cu,
        qk_normalized=qk_normalized,
    )
    return o.cpu(), state.cpu()


def test_available():
    assert tcd.available()


def test_varlen_grouped_heads_slots():
    """Lengths off the 64-token chunk (shorter than one, spanning three), two value heads per key head,
    a new sequence (src -1) beside two with states, moved to other slots; untouched slots stay."""
    lens, src, dst = [5, 70, 130], [-1, 3, 0], [1, 2, 0]
    q, k, v, g, beta, pool, cu = make_step(lens, hk=2, hv=4, dk=32, dv=32, slots=5)
    o, state = run(q, k, v, g, beta, pool, cu, src, dst)
    ref_o, ref_pool = reference(q, k, v, g, beta, pool, cu, src, dst)
    tol = TOL[torch.float32]
    assert o.dtype == torch.float32 and o.shape == ref_o.shape
    torch.testing.assert_close(o, ref_o, atol=tol, rtol=tol)
    torch.testing.assert_close(state, ref_pool, atol=tol, rtol=tol)
    assert torch.equal(state[3], pool[3]) and torch.equal(state[4], pool[4])  # read or untouched: unchanged


def test_prenormalized_qk_in_place():
    """q, k already L2-normalised (qk_normalized), one value head per key head, states updated in place,
    a one-token sequence and exactly one chunk."""
    lens, src, dst = [1, 64, 9], [0, 1, 2], [0, 1, 2]
    q, k, v, g, beta, pool, cu = make_step(lens, hk=2, hv=2, dk=32, dv=16, slots=3, seed=1)
    o, state = run(gdr.l2norm(q), gdr.l2norm(k), v, g, beta, pool, cu, src, dst, qk_normalized=True)
    ref_o, ref_pool = reference(q, k, v, g, beta, pool, cu, src, dst)
    tol = TOL[torch.float32]
    torch.testing.assert_close(o, ref_o, atol=tol, rtol=tol)
    torch.testing.assert_close(state, ref_pool, atol=tol, rtol=tol)


def test_shape_mismatch():
    q, k, v, g, beta, pool, cu = make_step([4], hk=2, hv=3, dk=16, dv=16, slots=1)
    with pytest.raises(ValueError, match=r"Hk \| Hv"):
        tcd.chunked_prefill(q, k, v, g, beta, pool, cu, torch.tensor([0]), torch.tensor([0]))


HALF = [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", HALF)
def test_model_head_dims_half(dtype):
    """Qwen3.5's head dims (dk = dv = 128: two of the state kernel's 64-row key blocks) in half precision,
    where fla keeps its intermediates in that dtype: against the fp32 reference of the same (rounded)
    inputs."""
    lens, src, dst = [3, 100], [-1, 0], [1, 0]
    q, k, v, g, beta, pool, cu = make_step(lens, hk=1, hv=2, dk=128, dv=128, slots=2, dtype=dtype, seed=2)
    o, state = run(q, k, v, g, beta, pool, cu, src, dst)
    ref_o, ref_pool = reference(q, k, v, g, beta, pool, cu, src, dst)
    assert o.dtype == dtype and state.dtype == torch.float32
    torch.testing.assert_close(o.float(), ref_o, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(state, ref_pool, atol=TOL[dtype], rtol=TOL[dtype])
