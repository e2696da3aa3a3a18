"""The CPU row argmax / top-k kernels (ember/kernels/cpu_row_top.*) against torch.argmax and
torch.topk: the same indices on random logits, on rows whose length leaves a vector tail (of 16 and of
8 lanes), with ties (first index wins), -inf, NaN (argmax: the first NaN, as torch), and the fallback
where the kernel does not apply; and the AVX2 build (-march=haswell) run through this module on an
AVX-512 machine."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_row_top
from ember.kernels.cpp_build import has_cpu_flags
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(
    not (has_cpu_flags("avx512f") or has_cpu_flags("avx2")), reason="the row kernels need AVX-512 or AVX2"
)


def kernel_ran(x: torch.Tensor) -> bool:
    return cpu_row_top._applies(x)


@pytest.mark.parametrize(
    "n,V", [(1, 1), (2, 7), (3, 15), (5, 16), (4, 17), (3, 25), (64, 49152), (7, 151_937), (2, 1000)]
)
def test_argmax_matches_torch(n, V):
    x = torch.randn(n, V, generator=torch.Generator().manual_seed(V))
    assert kernel_ran(x)
    assert torch.equal(cpu_row_top.argmax(x), x.argmax(dim=-1))


def test_argmax_ties_nan_and_inf():
    x = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    x[0, [7, 40, 99]] = 50.0  # a tie: the first index
    x[1] = float("-inf")  # all -inf: index 0
    x[2, 13] = float("nan")  # torch ranks NaN first
    x[2, 60] = float("nan")
    x[3, 99] = float("inf")  # in the vector tail
    x[4, 98] = float("nan")  # NaN only in the tail
    x[5, :] = 3.0
    got, want = cpu_row_top.argmax(x), x.argmax(dim=-1)
    assert torch.equal(got, want), (got, want)
    assert got.tolist()[:4] == [7, 0, 13, 99]


@pytest.mark.parametrize(
    "n,V,k", [(1, 8, 8), (3, 17, 5), (2, 13, 3), (64, 49152, 8), (4, 151_937, 16), (2, 33, 1), (3, 1001, 8)]
)
def test_topk_matches_torch(n, V, k):
    x = torch.randn(n, V, generator=torch.Generator().manual_seed(k + V))
    vals, idx = torch.ops.ember_cpu.topk_rows(x, k)
    want = x.topk(k, dim=-1)
    assert torch.equal(idx, want.indices) and torch.equal(vals, want.values)
    assert torch.equal(cpu_row_top.topk_indices(x, k), want.indices)


def test_topk_ascending_rows_and_ties():
    # every element beats the list: the insertion path on each one
    x = torch.arange(300, dtype=torch.float32).repeat(2, 1)
    x[1] = x[1].flip(0)
    assert torch.equal(cpu_row_top.topk_indices(x, 4), torch.tensor([[299, 298, 297, 296], [0, 1, 2, 3]]))
    t = torch.zeros(1, 40)
    t[0, [3, 30]] = 2.0
    assert cpu_row_top.topk_indices(t, 3).tolist() == [[3, 30, 0]]  # equal values in index order
    r = torch.full((1, 20), float("nan"))
    r[0, 5], r[0, 17] = 1.0, 2.0
    vals, idx = torch.ops.ember_cpu.topk_rows(r, 3)  # NaNs are never picked; the rest pads with -inf
    assert idx.tolist() == [[17, 5, 0]] and vals[0, 2] == float("-inf")


def test_falls_back_to_torch_where_the_kernel_does_not_apply():
    x = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    for y in (x.to(torch.bfloat16), x.t(), x[0]):
        assert not kernel_ran(y)
        assert torch.equal(cpu_row_top.argmax(y), y.argmax(dim=-1))
    assert torch.equal(cpu_row_top.topk_indices(x.t(), 3), x.t().topk(3, dim=-1).indices)


def test_bad_input_is_refused():
    with pytest.raises(RuntimeError, match="k must be in"):
        torch.ops.ember_cpu.topk_rows(torch.randn(2, 5), 6)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.ember_cpu.argmax_rows(torch.randn(2, 5, dtype=torch.float64))


@pytest.mark.parametrize("n_rows,V", [(1, 49152), (5, 17), (2, 12), (3, 151_937), (32, 49157)])
def test_mask_rows_matches_xgrammar(n_rows, V):
    """The bitmask kernel against xgrammar's own apply_token_bitmask_inplace: the chosen rows only,
    words all allowed (-1), all forbidden (0) and mixed, a vocabulary that leaves a tail."""
    import xgrammar as xgr

    g = torch.Generator().manual_seed(V)
    words = (V + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (n_rows, words), dtype=torch.int32, generator=g)
    bits[:, words // 3 : words // 2] = 0
    bits[:, words // 2 :] = -1
    logits = torch.randn(n_rows + 4, V, generator=g)
    rows = torch.randperm(n_rows + 4, generator=g)[:n_rows].tolist()  # some rows stay unmasked
    expected = logits.clone()
    full = torch.full((n_rows + 4, words), -1, dtype=torch.int32)
    full[rows] = bits
    xgr.apply_token_bitmask_inplace(expected, full, indices=rows)
    assert kernel_ran(logits)
    cpu_row_top.mask_rows(logits, bits, rows)
    assert torch.equal(logits, expected)


def test_mask_rows_falls_back_for_other_dtypes():
    x = torch.zeros(2, 40, dtype=torch.bfloat16)
    bits = torch.full((1, 2), -1, dtype=torch.int32)
    bits[0, 0] = 0b101
    cpu_row_top.mask_rows(x, bits, [1])
    assert torch.isinf(x[1]).sum() == 30 and not torch.isinf(x[1, [0, 2]]).any() and not torch.isinf(x[0]).any()


def test_the_build_is_this_cpus():
    """16 lanes where the CPU has AVX-512, else the AVX2 build's 8 (in the AVX2 child run below too)."""
    assert cpu_row_top.available()
    assert torch.ops.ember_cpu.row_top_lanes() == (16 if has_cpu_flags("avx512f") else 8)


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine's build is the 16-lane AVX-512 one, the 8-lane AVX2 build (Zen2/3, Haswell
    on) is compiled here with -march=haswell under the name this machine looks for, in a kernel dir of
    its own, and this module's other tests run against it in a child process that reads the CPU flags
    as such a machine's (tests/kernels/haswell_flags.py)."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build("cpu_row_top.cpp")
    probe = "import torch; from ember.kernels import cpu_row_top as r; r.available(); "
    probe += "print(torch.ops.ember_cpu.row_top_lanes())"
    said, run = avx2_child.probe_and_run(env, probe, __file__)
    assert said == ["8"]
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-2000:]
