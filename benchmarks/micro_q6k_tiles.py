"""Micro-benchmark of a Q6_K LM head: the old Q6KPart (torch's int4 kernel over a 2K-wide split) against
TiledQ6KPart (the tiled GEMV's Q6_K tiles: its bf16 GEMV at 1 row, its int8-x path from
TILED_Q8_MIN_ROWS rows), both through linear_float as the head calls them.

The head's shape of Qwen3.5-0.8B (the tied embedding, 248320 x 1024), random codes and scales, bf16 x.
Rounds alternate the two parts so that a neighbour's load on a shared machine hits both alike; prints
the median ms a call over ROUNDS rounds of CALLS calls, and the bytes each part holds a weight.

    .venv/bin/python benchmarks/micro_q6k_tiles.py                 # N=248320 K=1024 ROUNDS=5 CALLS=5
    ROWS=1,4,16 N=65536 .venv/bin/python benchmarks/micro_q6k_tiles.py
"""

import os
import time

import torch

from ember.kernels import cpu_tiled_gemv
from ember.quant.gguf_quant import Q6KPart, TiledQ6KPart

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
assert cpu_tiled_gemv.available() and cpu_tiled_gemv.has_q6k(), "the Q6_K tiles need the bf16 build (AVX-512 BF16)"
N, K = int(os.environ.get("N", 248320)), int(os.environ.get("K", 1024))
ROUNDS, CALLS = int(os.environ.get("ROUNDS", 5)), int(os.environ.get("CALLS", 5))
ROW_COUNTS = [int(r) for r in os.environ.get("ROWS", "1,16").split(",")]

g = torch.Generator().manual_seed(0)
q6 = torch.randint(0, 64, (N, K), generator=g, dtype=torch.uint8)
sub = torch.randint(-128, 128, (N, K // 16), generator=g, dtype=torch.int8)
d = (torch.rand(N, K // 256, generator=g) * 1e-3).half()
parts = {
    "Q6KPart": Q6KPart(q6, d.float().repeat_interleave(16, dim=1) * sub.float(), torch.bfloat16),
    "TiledQ6KPart": TiledQ6KPart(q6, sub, d),
}
del q6


def held(part) -> float:
    return sum(t.numel() * t.element_size() for t in part.buffers()) / (N * K)


for M in ROW_COUNTS:
    x = torch.randn(M, K, generator=g).bfloat16()
    times = {name: [] for name in parts}
    for part in parts.values():  # warm-up: first-call allocations, the spread cache
        part.linear_float(x)
    for _ in range(ROUNDS):
        for name, part in parts.items():
            t = time.perf_counter()
            for _ in range(CALLS):
                part.linear_float(x)
            times[name].append((time.perf_counter() - t) / CALLS)
    for name, ts in times.items():
        ms = sorted(ts)[len(ts) // 2] * 1e3
        print(f"{M:3d} rows  {name:13s} {ms:8.2f} ms a call  ({held(parts[name]):.3f} B a weight held)")
