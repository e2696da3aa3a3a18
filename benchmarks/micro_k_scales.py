"""Micro-benchmark of Q4_K's scales in the tiled GEMV: flat float32 (scale, offset) per 32 weights
(0.75 B a weight held) against the file's two levels kept (6-bit sc, m per 32, float16 d, dmin per 256:
0.578 B), same codes, same results (bit for bit: tests/kernels/test_cpu_tiled_gemv.py).

An [N, K] Q4_K matrix of random fields, x in the build's dtype (bf16 on AVX-512 BF16; float32 on AVX2:
EMBER_CPU_ISA=avx2 on an AVX-512 machine), the GEMV at 1 row and at 16 rows the int8-x path (bf16 build
with VNNI) or the GEMV's many-row path (AVX2 build), 2 threads; rounds alternate the two stores. Prints
the median ms a call over ROUNDS rounds of CALLS calls.

    PYTHONPATH=. .venv/bin/python benchmarks/micro_k_scales.py      # N=131072 K=1024 ROUNDS=9 CALLS=10
"""

import os
import time

import torch

from ember.kernels import cpu_tiled_gemv as tg

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
assert tg.available() and tg.has_k_scales(), "K-quant scales need the tiled GEMV"
X = tg.x_dtype()
N, K = int(os.environ.get("N", 131072)), int(os.environ.get("K", 1024))
ROUNDS, CALLS = int(os.environ.get("ROUNDS", 9)), int(os.environ.get("CALLS", 10))

g = torch.Generator().manual_seed(0)
codes = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
sc, m = (torch.randint(0, 64, (N, K // 32), generator=g, dtype=torch.uint8) for _ in range(2))
d, dmin = ((torch.rand(N, K // 256, generator=g) * 1e-3).half() for _ in range(2))
scale = d.float().repeat_interleave(8, dim=1) * sc.float()
offset = -(dmin.float().repeat_interleave(8, dim=1) * m.float())
stores = {"flat float32": tg.pack(codes, scale, offset, 4), "two-level": tg.pack_k(codes, sc, m, d, dmin, 4)}
del codes, scale, offset

for rows, op in ((1, tg.gemv), (16, tg.gemm_q8 if tg.has_q8() else tg.gemv)):
    x = torch.randn(rows, K, generator=g).to(X)
    times = {name: [] for name in stores}
    for packed in stores.values():
        op(x, *packed, 4, True)
    for _ in range(ROUNDS):
        for name, packed in stores.items():
            t = time.perf_counter()
            for _ in range(CALLS):
                op(x, *packed, 4, True)
            times[name].append((time.perf_counter() - t) / CALLS)
    for name, ts in times.items():
        held = sum(t.numel() * t.element_size() for t in stores[name]) / (N * K)
        print(f"{rows:3d} rows  {name:13s} {sorted(ts)[len(ts) // 2] * 1e3:8.3f} ms a call  ({held:.3f} B a weight)")
