"""Micro-benchmark of the 16-bit-weight kernel (ember/kernels/cpu_half_gemv.cpp) against what a float32
run did before it: F.linear over the weight widened to float32 at load. Shapes are the hybrid bench's
Qwen3.5-0.8B-shaped model's (gate_up, down, LM head), at the row counts of decode, batched decode and
prefill; both of the kernel's paths are timed at every row count (gemm_dispatch.HALF_GEMV_MAX_ROWS is
set from where they cross).

    [EMBER_CPU_ISA=avx2] python benchmarks/micro_half_gemv.py [--threads 2] [--reps 7]

EMBER_CPU_ISA=avx2 (ember.platform) builds the kernel -march=haswell and holds torch's GEMM to AVX2,
as on an AVX2-only CPU. Prints one markdown row per case: medians of --reps alternating timings (each
of enough calls for ~50 ms), in microseconds, and the weight bytes each streams per call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial


def calls_for(fn) -> int:
    fn()
    t0, calls = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.05 or calls < 2:
        fn()
        calls += 1
    return calls


def medians_us(fns, reps: int) -> list[float]:
    counts = [calls_for(f) for f in fns]
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, (fn, n) in enumerate(zip(fns, counts)):
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            times[i].append((time.perf_counter() - t0) / n * 1e6)
    return [statistics.median(t) for t in times]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--rows", default="1,2,4,8,16,32,64,256,1024")
    args = p.parse_args()
    import torch
    import torch.nn.functional as F

    from ember.kernels import cpu_half_gemv
    from ember.platform import isa_cap

    torch.set_num_threads(args.threads)
    assert cpu_half_gemv.available()
    g = torch.Generator().manual_seed(0)
    print(
        f"isa cap {isa_cap() or 'native'}, torch {torch.backends.cpu.get_cpu_capability()}, "
        f"{args.threads} threads, medians of {args.reps}"
    )
    print(
        "| weight [N, K] | rows | float32 F.linear (us) | bf16 GEMV (us) | bf16 panels + GEMM (us) | best / float32 |"
    )
    print("|---|---|---|---|---|---|")
    for name, N, K in (("gate_up", 7168, 1024), ("down", 1024, 3584), ("LM head", 248320, 1024)):
        w16 = (torch.randn(N, K, generator=g) * 0.02).bfloat16()
        w32 = w16.float()
        for M in (int(r) for r in args.rows.split(",")):
            if name == "LM head" and M > 64:
                continue
            x = torch.randn(M, K, generator=g)
            fns = [
                partial(F.linear, x, w32),
                partial(cpu_half_gemv.linear, x, w16, 1 << 30),
                partial(cpu_half_gemv.linear, x, w16, 0),
            ]
            ref, gemv, panels = medians_us(fns, args.reps)
            print(
                f"| {name} [{N}, {K}] | {M} | {ref:.0f} | {gemv:.0f} | {panels:.0f} | {ref / min(gemv, panels):.2f}x |",
                flush=True,
            )
        del w16, w32


if __name__ == "__main__":
    main()
