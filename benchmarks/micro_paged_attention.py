"""Micro-benchmark of the CPU paged decode attention kernel (the throughput probe's decode shape).

30 layers' KV caches (default model: 3 kv heads, 9 query heads, head size 64, bf16, blocks of 16
placed in random order), 64 sequences of 128..HI-1 keys drawn with SEED; each layer's cache is read
from DRAM since the 30 of them are far past L3. Prints the median of REPS passes over the layers.

    .venv/bin/python benchmarks/micro_paged_attention.py            # SEED=0 HI=641 REPS=5 L=30
    SEED=1000 HI=513 .venv/bin/python benchmarks/micro_paged_attention.py
"""

import os
import time

import torch

from ember.kernels.cpu_paged_attention import paged_attention, paged_attention_op

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
torch.manual_seed(0)
assert paged_attention_op() is not None, "the kernel did not build here"
L, B, bs, Hkv, Hq, D = int(os.environ.get("L", 30)), 64, 16, 3, 9, 64
g = torch.Generator().manual_seed(int(os.environ.get("SEED", 0)))
lens = torch.randint(128, int(os.environ.get("HI", 641)), (B,), generator=g, dtype=torch.int32)
W = (int(lens.max()) + bs - 1) // bs
nb = B * W + 8
caches = [torch.randn(2, nb, bs, Hkv, D).to(torch.bfloat16) for _ in range(L)]
q = torch.randn(B, Hq, D).to(torch.bfloat16)
tables = torch.randperm(nb, generator=g)[: B * W].view(B, W).to(torch.int32)
seq = torch.arange(B, dtype=torch.int32)
for _ in range(2):
    for c in caches:
        paged_attention(q, c, tables, seq, lens, 0.125)
times = []
for _ in range(int(os.environ.get("REPS", 5))):
    t = time.perf_counter()
    for c in caches:
        paged_attention(q, c, tables, seq, lens, 0.125)
    times.append((time.perf_counter() - t) / L)
t = sorted(times)[len(times) // 2]
keys = int(lens.sum())
print(f"{keys} keys: {t * 1e3:.3f} ms a layer, {keys * Hkv * D * 2 * 2 / t / 1e9:.1f} GB/s of K/V")
