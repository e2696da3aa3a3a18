"""Micro-benchmark of bf16 causal attention on CPU: the C++ kernel (flash-style, AVX512-BF16 dot
products) against the GEMM path (oneDNN bf16 GEMMs per block of queries) at blocks of 128 and 256
queries, at the default model's heads (9 / 3 x 64) and Qwen3.5's full-attention layers (8 / 2 x 256),
a 16 / 8 x 128 shape between, over prompts and prompt chunks. Medians of REPS alternating passes;
the last column is the GEMM path's largest difference from the kernel's output. Which of the two
ember runs is ember.kernels.cpu_causal_attention.amx_gemm_beats_flash's rule.

    .venv/bin/python benchmarks/micro_causal_attention.py          # THREADS=2 REPS=9
"""

import os
import time

import torch

from ember.kernels import cpu_causal_attention as ca

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
REPS = int(os.environ.get("REPS", 9))
assert ca.flash_available(), "the C++ kernel did not build here (it needs AVX512-BF16)"
SHAPES = [  # (queries, keys, q heads, kv heads, head dim)
    (128, 128, 9, 3, 64),
    (512, 512, 9, 3, 64),
    (512, 2048, 9, 3, 64),
    (2000, 2000, 9, 3, 64),
    (512, 512, 16, 8, 128),
    (2000, 2000, 16, 8, 128),
    (128, 128, 8, 2, 256),
    (512, 512, 8, 2, 256),
    (512, 2048, 8, 2, 256),
    (2000, 2000, 8, 2, 256),
]
print(f"AMX: {ca.AMX}, threads {torch.get_num_threads()}, median of {REPS} (ms)")
print(
    "| queries | keys | heads | head dim | C++ kernel | GEMM, 128 a block | GEMM, 256 a block | ember runs | max diff |"
)
print("|---:|---:|---|---:|---:|---:|---:|---|---:|")
for n, S, Hq, Hkv, D in SHAPES:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(m, h, D, generator=g).bfloat16() for m, h in ((n, Hq), (S, Hkv), (S, Hkv)))
    scale = D**-0.5

    def gemm(block: int) -> torch.Tensor:
        ca.BLOCK_QUERIES = block
        return ca.causal_attention_gemm(q, k, v, scale)

    ways = {
        "flash": lambda: ca.flash_attention(q, k, v, scale),
        "gemm128": lambda: gemm(128),
        "gemm256": lambda: gemm(256),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for f in ways.values():
        f()
    for _ in range(REPS):
        for name, f in ways.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    ms = {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}
    diff = (gemm(256).float() - ca.flash_attention(q, k, v, scale).float()).abs().max().item()
    chosen = "GEMM" if ca.amx_gemm_beats_flash(q, S) else "C++ kernel"
    print(
        f"| {n} | {S} | {Hq} / {Hkv} | {D} | {ms['flash']:.2f} | {ms['gemm128']:.2f} | {ms['gemm256']:.2f} | {chosen} | {diff:.4f} |"
    )
