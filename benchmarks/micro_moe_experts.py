"""Micro-benchmark of one MoE layer's experts at decode batches, in the two forms a step can run them:
the grouped path (grouped_experts: what eager runs, and what the ember::moe_experts op runs inside a
CPU graph) and gathered_experts compiled by inductor (fullgraph, the executor's default mode), which is
what a dense model's CPU graph holds (ember/layers/moe_compute.py). Random dense experts, E=64 top-8,
hidden 1024, expert intermediate 256; medians of 15 calls, 3 alternating rounds.

    .venv/bin/python benchmarks/micro_moe_experts.py               # bf16, batches 1 16 64
    DTYPE=float32 BATCHES="1 16" .venv/bin/python benchmarks/micro_moe_experts.py
"""

import os
import statistics
import time

import torch

from ember.layers.moe import Experts
from ember.layers.moe_compute import grouped_experts

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
E, k, H, I = 64, 8, 1024, 256
dtype = getattr(torch, os.environ.get("DTYPE", "bfloat16"))
torch.manual_seed(0)
experts = Experts(E, H, I, dtype)
experts.w13.data.normal_(0, 0.02)
experts.w2.data.normal_(0, 0.02)
forms = {
    "grouped (eager, the op)": lambda x, ids, w: grouped_experts(x, ids, w, E, experts.expert_forward),
    "gathered, compiled": torch.compile(
        experts.gathered, fullgraph=True, dynamic=False, mode="max-autotune-no-cudagraphs"
    ),
}


def median_ms(f, args, n=15) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f(*args)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


for T in map(int, os.environ.get("BATCHES", "1 16 64").split()):
    x = torch.randn(T, H, dtype=dtype)
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)])
    w = torch.softmax(torch.randn(T, k), -1).to(dtype)
    for f in forms.values():
        f(x, ids, w)  # compile, warm
    rounds = {name: [median_ms(f, (x, ids, w)) for _ in range(1)] for name, f in forms.items()}
    for _ in range(2):
        for name, f in forms.items():
            rounds[name].append(median_ms(f, (x, ids, w)))
    for name, r in rounds.items():
        print(
            f"{dtype} batch {T:2d} {name:24s} {statistics.median(r):8.2f} ms  (rounds {', '.join(f'{v:.2f}' for v in r)})"
        )
