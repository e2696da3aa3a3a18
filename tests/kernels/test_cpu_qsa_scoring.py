"""The C++ QSA block scoring and top-k (ember/kernels/cpu_qsa_scoring.*) against the torch path
(ember.layers.qsa: the einsum scores, top_blocks): scores within float32 rounding on odd head sizes and head
counts; the selection equal block for block on integer-valued queries and keys (every score exact in any
summation order, so ties are exact and many), decode rows of several sequences and prefill rows, float32 and
bf16 queries, ties at the cut in both of torch.topk's regimes (partial sort where k * 64 <= n, selection
otherwise); the indexer's select_blocks with the kernel equal to the mask-form reference; bad rows refused;
and the AVX2 build (-march=haswell) run through this module on an AVX-512 machine."""

from __future__ import annotations

import math

import pytest
import torch

from ember.kernels import cpu_qsa_scoring
from ember.kernels.cpp_build import has_cpu_flags
from ember.layers import qsa
from tests.kernels import avx2_child
from tests.layers.test_qsa_selection import Q_LENS, SEQ_LENS, reference_masks, step

pytestmark = pytest.mark.skipif(
    not (has_cpu_flags("avx512f") or has_cpu_flags("avx2", "fma")), reason="the kernel needs AVX-512 or AVX2 + FMA"
)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    assert cpu_qsa_scoring.available()


def torch_scores(q: torch.Tensor, keys: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """The torch path's scores of each row over its sequence's blocks ([T, nb], float32)."""
    s = torch.einsum("nhd,nbd->nhb", q.float(), keys.float()[seq])
    return torch.relu(s).sum(1) / math.sqrt(q.shape[-1])


def integer_step(g, B: int, nb: int, T: int, h: int, d: int, dtype, prefill: bool):
    """Queries and keys of small integers (products and sums exact in float32 and bf16). Decode rows: random
    sequences and visible counts; prefill: every row of sequence 0, its visible blocks growing by one in 4."""
    keys = torch.randint(-2, 2, (B, nb, d), generator=g).float()
    q = torch.randint(-2, 2, (T, h, d), generator=g).to(dtype)
    if prefill:
        seq = torch.zeros(T, dtype=torch.int64)
        nc = (torch.arange(nb * 4 - T, nb * 4) + 1) // 4
    else:
        seq = torch.randint(0, B, (T,), generator=g)
        nc = torch.randint(0, nb + 1, (T,), generator=g)
    return q, keys, seq, nc


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefill", [False, True])
def test_the_selection_is_the_torch_paths_ties_included(dtype, prefill):
    g = torch.Generator().manual_seed(int(prefill))
    tied = {True: 0, False: 0}  # rows whose cut ties, by torch.topk's regime (partial sort or not)
    for trial in range(16):
        h, d = [(1, 16), (2, 12), (4, 128), (5, 8)][trial % 4]
        nb, k = [(90, 20), (700, 3), (300, 150), (37, 36)][trial // 4 % 4]
        q, keys, seq, nc = integer_step(g, 3, nb, 32, h, d, dtype, prefill)
        scores = torch_scores(q, keys, seq)
        got = cpu_qsa_scoring.select_blocks(q, keys, seq, nc, k)
        assert torch.equal(got, qsa.top_blocks(scores, nc, k)), (trial, h, d, nb, k)
        visible = scores.masked_fill(torch.arange(nb)[None] >= nc[:, None], float("-inf"))
        for i in qsa.boundary_ties(visible, nc, k).tolist():
            tied[k * 64 <= int(nc[i])] += 1
    assert tied[True] > 10 and tied[False] > 10, tied


@pytest.mark.parametrize("h, d", [(1, 20), (3, 12), (4, 128), (6, 64)])
def test_scores_match_the_torch_path(h, d):
    g = torch.Generator().manual_seed(h * d)
    keys = torch.randn(2, 53, d, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(9, h, d, generator=g).to(dtype)
        seq = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 1])
        nc = torch.tensor([0, 1, 53, 52, 7, 8, 9, 30, 31])
        got = cpu_qsa_scoring.block_scores(q, keys, seq, nc)
        visible = torch.arange(53)[None] < nc[:, None]
        want = torch_scores(q, keys, seq).masked_fill(~visible, float("-inf"))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [20, 64, 400])  # 5 blocks; 16; more than any row sees
def test_the_indexer_with_the_kernel_is_the_mask_form(budget):
    """QSAIndexer.select_blocks over a step of decodes and a prefill chunk (tests/layers/test_qsa_selection's)."""
    ix, q, meta, cos_sin = step(budget)
    torch_sel = ix.select_blocks(q, meta, cos_sin)
    ix.cpu_scoring = True
    for dtype in (torch.float32, torch.bfloat16):
        sel = ix.select_blocks(q.to(dtype), meta, cos_sin)
        if dtype == torch.float32:
            assert torch.equal(sel.blocks, torch_sel.blocks)
            s = 0
            for n, N, want in zip(Q_LENS, SEQ_LENS, reference_masks(ix, q, meta, cos_sin)):
                assert torch.equal(sel.mask(N)[s : s + n], want)
                s += n
        for name in ("tail_start", "kv_lens", "seq_idx"):
            assert torch.equal(getattr(sel, name), getattr(torch_sel, name))


def test_bad_rows_are_refused():
    q, keys = torch.randn(2, 2, 16), torch.randn(2, 10, 16)
    seq, nc = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3, 10], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="names sequence"):
        torch.ops.ember_cpu.qsa_select_blocks(q, keys, seq + 1, nc, 2)
    with pytest.raises(RuntimeError, match="sees 11 blocks of 10"):
        torch.ops.ember_cpu.qsa_select_blocks(q, keys, seq, nc + 1, 2)
    with pytest.raises(RuntimeError, match="with q's d"):
        torch.ops.ember_cpu.qsa_select_blocks(q, keys[..., :8].contiguous(), seq, nc, 2)
    assert not cpu_qsa_scoring.supports(q.half(), keys)  # fp16 queries: the torch path


def test_the_build_is_this_cpus():
    """16 lanes where the CPU has AVX-512, else the AVX2 build's 8 (in the AVX2 child run below too)."""
    assert cpu_qsa_scoring.available()
    assert torch.ops.ember_cpu.qsa_scoring_lanes() == (16 if has_cpu_flags("avx512f") else 8)


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine's build is the AVX-512 one, the AVX2 build (-march=haswell) runs this module's other
    tests in a child process that reads the CPU flags as such a machine's (tests/kernels/avx2_child.py)."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build("cpu_qsa_scoring.cpp", also=("cpu_fused_elementwise.cpp",))  # its indexer tests' norms
    probe = "import torch; from ember.kernels import cpu_qsa_scoring as k; k.available(); "
    probe += "print(torch.ops.ember_cpu.qsa_scoring_lanes())"
    said, run = avx2_child.probe_and_run(env, probe, __file__)
    assert said == ["8"]
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-2000:]
