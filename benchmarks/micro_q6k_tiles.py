"""Micro-benchmark of a Q6_K matrix: the old Q6KPart (torch's int4 kernel over a 2K-wide split) against
TiledQ6KPart (the tiled GEMV's Q6_K tiles: the bf16 build's GEMV at 1 row and its int8-x path from
TILED_Q8_MIN_ROWS rows; the AVX2 build's int16-x GEMV at every row count, its many-row path from 16),
both through linear_float as the head calls them. In the AVX2 build also "dense f32": F.linear over the
float32 weight, the copy --int4-dense-copy auto gave a Q4_K_M file's Q6_K layers there for many-row steps
before the tiles (a step of fewer rows ran Q6KPart).

x is in the build's dtype: bf16 on AVX-512 BF16, float32 on AVX2 (EMBER_CPU_ISA=avx2 runs an AVX-512
machine as an AVX2 one: the -march=haswell build, torch's GEMMs held to AVX2). Random codes and scales,
the shape of Qwen3.5-0.8B's head by default (the tied embedding, 248320 x 1024). Rounds alternate the
parts so that a neighbour's load on a shared machine hits each alike; prints the median ms a call over
ROUNDS rounds of CALLS calls, and the bytes each holds a weight.

    .venv/bin/python benchmarks/micro_q6k_tiles.py                 # N=248320 K=1024 ROUNDS=9 CALLS=5
    ROWS=1,16,128 N=1024 K=3584 EMBER_CPU_ISA=avx2 EMBER_KERNEL_DIR=/tmp/k .venv/bin/python benchmarks/micro_q6k_tiles.py
"""

import os
import time

import torch
import torch.nn.functional as F

from ember.kernels import cpu_tiled_gemv
from ember.quant.gguf_quant import Q6KPart, TiledQ6KPart

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
assert cpu_tiled_gemv.available() and cpu_tiled_gemv.has_q6k(), "the Q6_K tiles need the tiled GEMV"
X = cpu_tiled_gemv.x_dtype()
N, K = int(os.environ.get("N", 248320)), int(os.environ.get("K", 1024))
ROUNDS, CALLS = int(os.environ.get("ROUNDS", 9)), int(os.environ.get("CALLS", 5))
ROW_COUNTS = [int(r) for r in os.environ.get("ROWS", "1,16").split(",")]

g = torch.Generator().manual_seed(0)
q6 = torch.randint(0, 64, (N, K), generator=g, dtype=torch.uint8)
sub = torch.randint(-128, 128, (N, K // 16), generator=g, dtype=torch.int8)
d = (torch.rand(N, K // 256, generator=g) * 1e-3).half()
parts = {
    "Q6KPart": Q6KPart(q6, d.float().repeat_interleave(16, dim=1) * sub.float(), X),
    "TiledQ6KPart": TiledQ6KPart(q6, sub, d),
}
del q6
calls = {name: part.linear_float for name, part in parts.items()}
held = {name: sum(t.numel() * t.element_size() for t in part.buffers()) / (N * K) for name, part in parts.items()}
if X == torch.float32:
    dense = parts["TiledQ6KPart"].dequantize()
    calls["dense f32"] = lambda x: F.linear(x, dense)
    held["dense f32"] = 4.0

for M in ROW_COUNTS:
    x = torch.randn(M, K, generator=g).to(X)
    times = {name: [] for name in calls}
    for call in calls.values():  # warm-up: first-call allocations, the spread cache
        call(x)
    for _ in range(ROUNDS):
        for name, call in calls.items():
            t = time.perf_counter()
            for _ in range(CALLS):
                call(x)
            times[name].append((time.perf_counter() - t) / CALLS)
    for name, ts in times.items():
        ms = sorted(ts)[len(ts) // 2] * 1e3
        print(f"{M:3d} rows  {name:13s} {ms:9.3f} ms a call  ({held[name]:.3f} B a weight held)", flush=True)
