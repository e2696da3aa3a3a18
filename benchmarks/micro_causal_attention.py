"""Micro-benchmark of causal attention on CPU.

bf16 (the default): the C++ kernel (flash-style, AVX512-BF16 dot products) against the GEMM path
(oneDNN bf16 GEMMs per block of queries) at blocks of 128 and 256 queries, at the default model's
heads (9 / 3 x 64) and Qwen3.5's full-attention layers (8 / 2 x 256), a 16 / 8 x 128 shape between,
over prompts and prompt chunks. Medians of REPS alternating passes; the last column is the GEMM
path's largest difference from the kernel's output. Which of the two ember runs is
ember.kernels.cpu_causal_attention.amx_gemm_beats_flash's rule.

float32 (`float32` argument; the dtype of --dtype auto on CPUs without AVX512-BF16): the C++ kernel's
float32 form over float32 and over bf16 keys / values, the GEMM path in float32 and torch's SDPA (the
reference backend's path) at the same heads; "ember runs" is attention_path's choice. Under
EMBER_CPU_ISA=avx2 (ember.platform) an AVX-512 machine runs it as an AVX2-only one would: the kernel's
-march=haswell build, oneDNN, MKL and ATen held to AVX2.

    .venv/bin/python benchmarks/micro_causal_attention.py          # THREADS=2 REPS=9
    EMBER_CPU_ISA=avx2 .venv/bin/python benchmarks/micro_causal_attention.py float32
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

from ember.kernels import cpu_causal_attention as ca
from ember.kernels.torch_attention import prefill_attention

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
REPS = int(os.environ.get("REPS", 9))


def medians(ways: dict) -> dict[str, float]:
    """ms: the median of REPS alternating passes of each way, after one warm-up pass."""
    times: dict[str, list[float]] = {name: [] for name in ways}
    for f in ways.values():
        f()
    for _ in range(REPS):
        for name, f in ways.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {name: sorted(t)[len(t) // 2] * 1e3 for name, t in times.items()}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference backend's float32 path: a prompt's causal SDPA, a chunk's SDPA with a mask."""
    n, S = q.shape[0], k.shape[0]
    if n == S:
        return prefill_attention(q, k, v, scale)
    mask = torch.arange(S)[None, :] <= torch.arange(S - n, S)[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=scale,
        enable_gqa=True,
    )  # fmt: skip
    return o[0].transpose(0, 1)


F32_SHAPES = [  # (queries, keys, q heads, kv heads, head dim)
    (16, 16, 9, 3, 64),
    (48, 48, 9, 3, 64),
    (128, 128, 9, 3, 64),
    (512, 512, 9, 3, 64),
    (512, 2048, 9, 3, 64),
    (2000, 2000, 9, 3, 64),
    (128, 128, 8, 2, 256),
    (512, 512, 8, 2, 256),
    (2000, 2000, 8, 2, 256),
]


def float32_table() -> None:
    assert ca.flash_available(torch.float32), "the C++ kernel did not build here (it needs AVX2 + FMA or AVX-512)"
    lanes = torch.ops.ember_cpu.causal_attention_lanes()
    print(f"float32, kernel lanes {lanes}, threads {torch.get_num_threads()}, median of {REPS} (ms)")
    print(
        "| queries | keys | heads | head dim | C++ kernel | C++ kernel, bf16 k/v | GEMM | SDPA | ember runs | max err |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for n, S, Hq, Hkv, D in F32_SHAPES:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(m, h, D, generator=g) for m, h in ((n, Hq), (S, Hkv), (S, Hkv)))
        kb, vb = k.bfloat16(), v.bfloat16()
        scale = D**-0.5
        ms = medians(
            {
                "flash": lambda: ca.flash_attention(q, k, v, scale),
                "flash_bf16_kv": lambda: ca.flash_attention(q, kb, vb, scale),
                "gemm": lambda: ca.causal_attention_gemm(q, k, v, scale),
                "sdpa": lambda: sdpa(q, k, v, scale),
            }
        )
        err = (ca.flash_attention(q, k, v, scale).double() - sdpa(q.double(), k.double(), v.double(), scale)).abs()
        chosen = {"flash": "C++ kernel", "gemm": "GEMM", None: "SDPA"}[ca.attention_path(q, S)]
        print(
            f"| {n} | {S} | {Hq} / {Hkv} | {D} | {ms['flash']:.2f} | {ms['flash_bf16_kv']:.2f} | {ms['gemm']:.2f} "
            f"| {ms['sdpa']:.2f} | {chosen} | {err.max().item():.1e} |"
        )


if sys.argv[1:] == ["float32"]:
    float32_table()
    sys.exit(0)
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
    ms = medians(ways)
    diff = (gemm(256).float() - ca.flash_attention(q, k, v, scale).float()).abs().max().item()
    chosen = "GEMM" if ca.amx_gemm_beats_flash(q, S) else "C++ kernel"
    print(
        f"| {n} | {S} | {Hq} / {Hkv} | {D} | {ms['flash']:.2f} | {ms['gemm128']:.2f} | {ms['gemm256']:.2f} | {chosen} | {diff:.4f} |"
    )
