"""The C++ QSA selected-block attention (ember/kernels/cpu_qsa_attention.*) against the masked torch
reference (ember.layers.qsa.masked_attention over the mask form of the same selection): fp32 within 1e-5,
bf16 within a bf16 rounding; head dims 32..256, block sizes 16 / 32, ratio 4, GQA groups 1 / 2 / 6,
sequences ending mid-block and mid-page, budgets below and above the visible blocks, decodes and prefill
chunks in one step, a batch-1 decode split over the threads; bad selections refused; and the AVX2 build
(-march=haswell) run through this module on an AVX-512 machine."""

from __future__ import annotations

import random

import pytest
import torch

from ember.kernels import cpu_qsa_attention
from ember.kernels.cpp_build import has_cpu_flags
from ember.layers.qsa import BlockSelection, gathered_attention, masked_attention
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(
    not (has_cpu_flags("avx512f") or has_cpu_flags("avx2", "fma")), reason="the kernel needs AVX-512 or AVX2 + FMA"
)
RATIO = 4


class QSAStep:
    """Sequences (q_len, seq_len) over a paged cache of random values behind shuffled block tables, q_len query
    rows at each sequence's end, each row keeping a random min(visible, k) of its visible blocks (k: the
    budget in blocks) plus its tail."""

    def __init__(self, q_lens, seq_lens, k, D, group, block_size, dtype, hkv=2, seed=0):
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        pages = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(pages) + 3
        self.cache = torch.randn(2, num_blocks, block_size, hkv, D, generator=g).to(dtype)
        free = list(range(num_blocks))
        rng.shuffle(free)
        tables = [[free.pop() for _ in range(n)] for n in pages]
        width = max(pages) + 1
        self.block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        self.block_size = block_size
        seq, pos = [], []
        for b, (n, s) in enumerate(zip(q_lens, seq_lens)):
            seq += [b] * n
            pos += range(s - n, s)
        rows = []
        for p in pos:
            nc = (p + 1) // RATIO
            chosen = sorted(rng.sample(range(nc), min(nc, k)))
            rows.append(chosen + [-1] * (k - len(chosen)))
        self.sel = BlockSelection(
            torch.tensor(rows, dtype=torch.int32).view(len(pos), k),
            torch.tensor([RATIO * ((p + 1) // RATIO) for p in pos], dtype=torch.int32),
            torch.tensor([p + 1 for p in pos], dtype=torch.int32),
            torch.tensor(seq, dtype=torch.int32),
            RATIO,
        )
        self.q = torch.randn(len(pos), hkv * group, D, generator=g).to(dtype)

    def kernel(self, scale: float) -> torch.Tensor:
        s = self.sel
        args = (s.seq_idx, s.blocks, s.tail_start, s.kv_lens, s.ratio, scale)
        return cpu_qsa_attention.qsa_attention(self.q, self.cache, self.block_tables, *args)

    def reference(self, scale: float) -> torch.Tensor:
        """Row by row: masked_attention over the row's sequence's first kv_len tokens, under the mask form."""
        Hkv, D = self.cache.shape[-2:]
        keys, values = (self.cache[i].reshape(-1, Hkv, D) for i in (0, 1))
        out = []
        for i in range(self.q.shape[0]):
            N, b = int(self.sel.kv_lens[i]), int(self.sel.seq_idx[i])
            t = torch.arange(N)
            slots = self.block_tables[b, t // self.block_size].long() * self.block_size + t % self.block_size
            mask = self.sel.mask(N)[i : i + 1]
            out.append(masked_attention(self.q[i : i + 1], keys[slots], values[slots], mask, scale))
        return torch.cat(out)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    if want.dtype == torch.bfloat16:  # both round the same float32 result to bf16: an ulp apart at most
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# one step: three decodes (ending mid-block and mid-page, one with fewer visible blocks than the budget) and
# a prefill chunk of 23 queries from index 150 on (its rows' visible blocks grow through the chunk)
Q_LENS, SEQ_LENS = [1, 1, 23, 1], [37, 203, 173, 6]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 2, 6])
@pytest.mark.parametrize("D", [32, 64, 128, 256])
def test_matches_the_masked_reference(D, group, dtype):
    for block_size, k in ((16, 5), (32, 60)):  # a budget below every long row's visible blocks, then above
        step = QSAStep(Q_LENS, SEQ_LENS, k, D, group, block_size, dtype, seed=D + group)
        assert cpu_qsa_attention.supports(step.q, step.cache)
        scale = D**-0.5
        want = step.reference(scale)
        assert_close(step.kernel(scale), want)
        assert_close(gathered_attention(step.q, step.cache, step.block_tables, step.sel, scale), want)


def test_a_batch_one_decode_is_split_over_the_threads():
    """One row and one kv head (one task) over 1,203 keys: cut into parts on 4 threads, merged, as one part."""
    step = QSAStep([1], [1203], 300, 128, 6, 16, torch.float32, hkv=1, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        split = step.kernel(0.1)
        torch.set_num_threads(1)
        whole = step.kernel(0.1)
    finally:
        torch.set_num_threads(before)
    assert_close(split, step.reference(0.1))
    assert_close(whole, step.reference(0.1))


def test_a_row_with_only_its_tail_and_one_without_a_tail():
    step = QSAStep([3], [4], 4, 32, 2, 16, torch.float32)  # rows at indices 1, 2, 3: tails of 2 and 3, then block 0
    assert step.sel.blocks.tolist() == [[-1] * 4, [-1] * 4, [0, -1, -1, -1]]
    assert step.sel.tail_start.tolist() == [0, 0, 4]
    assert_close(step.kernel(0.2), step.reference(0.2))


def test_bad_selections_are_refused():
    step = QSAStep([1], [40], 3, 32, 2, 16, torch.float32)
    sel = step.sel
    args = [step.q.float(), step.cache, step.block_tables, sel.seq_idx, sel.blocks, sel.tail_start, sel.kv_lens]
    bad = sel.blocks.clone()
    bad[0, 0] = 10  # tokens 40..43: past the tail's start
    with pytest.raises(RuntimeError, match="does not end before its tail"):
        torch.ops.ember_cpu.qsa_attention(*args[:4], bad, *args[5:], RATIO, 1.0)
    with pytest.raises(RuntimeError, match="names sequence"):
        torch.ops.ember_cpu.qsa_attention(*args[:3], sel.seq_idx + 1, *args[4:], RATIO, 1.0)
    with pytest.raises(RuntimeError, match="outside its block table"):
        torch.ops.ember_cpu.qsa_attention(*args[:6], sel.kv_lens + 100, RATIO, 1.0)
    assert not cpu_qsa_attention.supports(step.q.half(), step.cache.half())  # fp16: the torch path


def test_the_build_is_this_cpus():
    """16 lanes where the CPU has AVX-512, else the AVX2 build's 8 (in the AVX2 child run below too)."""
    assert cpu_qsa_attention.available()
    assert torch.ops.ember_cpu.qsa_attention_lanes() == (16 if has_cpu_flags("avx512f") else 8)


@pytest.mark.slow
def test_avx2_build_passes_this_module():
    """Where this machine's build is the 16-lane AVX-512 one, the 8-lane AVX2 build (Zen2/3, Haswell on) is
    compiled here with -march=haswell under the name this machine looks for, in a kernel dir of its own, and
    this module's other tests run against it in a child process that reads the CPU flags as such a machine's."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build("cpu_qsa_attention.cpp")
    probe = "import torch; from ember.kernels import cpu_qsa_attention as k; k.available(); "
    probe += "print(torch.ops.ember_cpu.qsa_attention_lanes())"
    said, run = avx2_child.probe_and_run(env, probe, __file__)
    assert said == ["8"]
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-2000:]
