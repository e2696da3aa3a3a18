"""Micro-benchmark of one qwen4_exp sparse (QSA) attention layer's decode step on CPU: the selection in
index form plus the C++ selected-block kernel (what QSAGatedAttention._sparse runs) against the torch masked
path it replaced (QSAIndexer.select's [1, N] mask, then masked_attention over the sequence's gathered K/V),
and each half alone; then the selection alone (select_blocks) with the torch scoring and top-k against the C++
one (ember.kernels.cpu_qsa_scoring, CpuKernels.qsa_scoring), for the decode row and for a prefill chunk of the
sequence's last PREFILL rows (default 2,000, at most N).

The release's attention shapes by default: 24 query heads over 2 kv heads of 256, an indexer of 4 heads x
128, ratio 4, bf16 KV in pages of 16 placed in random order, one sequence of N tokens (random values: the
selection's cost does not depend on them). Medians of REPS alternating passes, ms.

    .venv/bin/python benchmarks/micro_qsa_attention.py                  # N=2000 BUDGET=512 THREADS=2
    N=8000 BUDGET=2048 .venv/bin/python benchmarks/micro_qsa_attention.py
    N=4000 PREFILL=2000 .venv/bin/python benchmarks/micro_qsa_attention.py
"""

import os
import time

import torch

from ember.config.model_config import IndexerConfig, RopeConfig
from ember.kernels import cpu_qsa_attention, cpu_qsa_scoring
from ember.kernels.metadata import AttentionMetadata
from ember.layers.qsa import QSAIndexer, masked_attention, selected_attention, sequence_slots
from ember.layers.rotary import RotaryEmbedding

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
N, BUDGET, REPS = int(os.environ.get("N", 2000)), int(os.environ.get("BUDGET", 512)), int(os.environ.get("REPS", 21))
HQ, HKV, D, IH, ID, BS, DT = 24, 2, 256, 4, 128, 16, torch.bfloat16
PREFILL = min(N, int(os.environ.get("PREFILL", 2000)))
assert cpu_qsa_attention.available() and cpu_qsa_scoring.available(), "the kernels did not build here"
g = torch.Generator().manual_seed(0)
pages = -(-N // BS)
cache = torch.randn(2, pages + 4, BS, HKV, D, generator=g).to(DT)
table = torch.randperm(pages + 4, generator=g)[:pages].to(torch.int32)[None, :]
ix = QSAIndexer(IndexerConfig(IH, ID, BUDGET, 4), 64, 1e-6, DT, "cpu")
ix.keys = torch.randn((pages + 4) * BS, ID, generator=g).to(DT)
meta = AttentionMetadata(torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1], dtype=torch.int32),
                         torch.tensor([N], dtype=torch.int32), table, BS, [1], [N], 1, N)  # fmt: skip
cos_sin = tuple(c.to(DT) for c in RotaryEmbedding(ID, RopeConfig(theta=1e7), N + 1).get_cos_sin(torch.arange(N)))
q = torch.randn(1, HQ, D, generator=g).to(DT)
iq = torch.randn(1, IH, ID, generator=g).to(DT)
slots = sequence_slots(meta, 0, N)
keys, values = (cache[i].reshape(-1, HKV, D) for i in (0, 1))


def old_select():
    return ix.select(iq, ix.keys[slots], N - 1, cos_sin)


def old_attend(mask):
    return masked_attention(q, keys[slots], values[slots], mask, D**-0.5)


def new_select():
    ix.cpu_scoring = True
    return ix.select_blocks(iq, meta, cos_sin)


def torch_select_blocks(q_rows, m):
    ix.cpu_scoring = False
    return ix.select_blocks(q_rows, m, cos_sin)


def kernel_select_blocks(q_rows, m):
    ix.cpu_scoring = True
    return ix.select_blocks(q_rows, m, cos_sin)


def new_attend(sel):
    return selected_attention(q, cache, table, sel, D**-0.5, True)


mask, sel = old_select(), new_select()
assert torch.equal(sel.mask(N), mask)
err = (new_attend(sel).float() - old_attend(mask).float()).abs().max().item()
cases = {
    "torch masked path (select + masked_attention)": lambda: old_attend(old_select()),
    "index form + C++ kernel (select_blocks + selected_attention)": lambda: new_attend(new_select()),
    "  torch: select (mask)": old_select,
    "  torch: masked_attention": lambda: old_attend(mask),
    "  select_blocks (index form, C++ scoring)": new_select,
    "  C++ kernel": lambda: new_attend(sel),
    "  select_blocks, torch scoring + top-k (decode row)": lambda: torch_select_blocks(iq, meta),
    "  select_blocks, C++ scoring + top-k (decode row)": lambda: kernel_select_blocks(iq, meta),
}
# a prefill chunk: the sequence's last PREFILL rows in one step (the selection only; its attention is the same kernel)
meta_p = AttentionMetadata(torch.zeros(PREFILL, dtype=torch.int64), torch.tensor([0, PREFILL], dtype=torch.int32),
                           torch.tensor([N], dtype=torch.int32), table, BS, [PREFILL], [N], PREFILL, N)  # fmt: skip
iq_p = torch.randn(PREFILL, IH, ID, generator=g).to(DT)
assert torch.equal(torch_select_blocks(iq_p, meta_p).blocks, kernel_select_blocks(iq_p, meta_p).blocks)
cases[f"  select_blocks, torch scoring + top-k ({PREFILL} prefill rows)"] = lambda: torch_select_blocks(iq_p, meta_p)
cases[f"  select_blocks, C++ scoring + top-k ({PREFILL} prefill rows)"] = lambda: kernel_select_blocks(iq_p, meta_p)
times = {name: [] for name in cases}
for rep in range(REPS + 2):
    for name, fn in cases.items():
        if "prefill" in name and rep % 4:  # a quarter of the passes: each is ~100x a decode's
            continue
        t = time.perf_counter()
        fn()
        if rep >= 2:
            times[name].append((time.perf_counter() - t) * 1e3)
print(f"N={N} budget={BUDGET} ({int(sel.mask(N).sum())} tokens kept) threads={torch.get_num_threads()} "
      f"max |kernel - masked| = {err:.1e} (bf16 out)")  # fmt: skip
for name, ts in times.items():
    print(f"{name:62s} {sorted(ts)[len(ts) // 2]:8.3f} ms")
