"""Memory read bandwidth, measured in the benchmark's own run: the ceiling for batch-1 decode.

Batch-1 decode reads every weight once per token, so weight bytes x tok/s against this figure
says how close ember's decode step is to what the memory can deliver.
"""

from __future__ import annotations

import time

METHOD = (
    "memory bandwidth: best of 5 torch sum() passes over a {mib} MiB float32 tensor (read only), "
    "same thread count, in the benchmark driver between measurements"
)


def read_gbps(mib: int = 512, passes: int = 5) -> float:
    """GB/s (1e9 bytes) of the fastest of `passes` full reads of a `mib` MiB tensor."""
    import torch

    x = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)  # ones: every page really allocated
    x.sum()  # warm: page faults and thread pool start-up out of the timing
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9
