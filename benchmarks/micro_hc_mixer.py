"""Micro-benchmark of one qwen4_exp hyper-connection mixer on CPU: the torch path (HyperConnection's reference
forward) against the C++ mixer (ember.kernels.cpu_hc_mixer, as HyperConnection runs it: fused for plain matrices
up to FUSED_MAX_ROWS rows, its norm / gated-mean ends around the layer's own projections above, and always for
packed GGUF parts), at decode (1 row), a 16-sequence decode (16 rows) and a prefill chunk (ROWS_PREFILL rows).

Shapes: the bench model's, scaled from the release (hidden 2560, lowrank 320): H=HIDDEN (2048) with lowrank
H / 8, 4 streams, float32 activations (an AVX2 CPU runs float32) and the matrices as the runs hold them:
`f32` (a float32 folder or F32 GGUF), `bf16` (a BF16 GGUF file or --cpu-half-weights: HalfPart under float32),
`q8_0` (a Q8_0 GGUF file: the tiled GEMV's parts, so the split path). Random values. Medians of REPS
alternating passes, ms.

    .venv/bin/python benchmarks/micro_hc_mixer.py                   # HIDDEN=2048 THREADS=2
    WEIGHTS=bf16 ROWS=1,16 .venv/bin/python benchmarks/micro_hc_mixer.py
"""

import os
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType, quantize

from ember.kernels import cpu_hc_mixer
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.hyper_connection import HyperConnection
from ember.quant.gguf_blocks import GGUFTensor
from ember.quant.gguf_quant import GGUFLinearMethod

torch.set_num_threads(int(os.environ.get("THREADS", 2)))
H, N = int(os.environ.get("HIDDEN", 2048)), 4
L = int(os.environ.get("LOWRANK", H // 8))
ROWS = [int(r) for r in os.environ.get("ROWS", "1,16,64,2000").split(",")]
KINDS = os.environ.get("WEIGHTS", "f32,bf16,q8_0").split(",")
REPS = int(os.environ.get("REPS", 15))
assert cpu_hc_mixer.available(), "the kernel did not build here"


def mixer(kind: str, cpu_kernel: bool, weights: dict) -> HyperConnection:
    """A mixer holding `weights` (name -> float32 [out, in]) as a `kind` run holds them."""
    gguf = kind != "f32"
    method = (lambda name: GGUFLinearMethod(CpuKernels())) if gguf else (lambda name: None)
    hc = HyperConnection(H, N, L, 1e-6, torch.float32, "cpu", True, method, cpu_kernel=cpu_kernel)
    with torch.no_grad():
        hc.hc_norm.weight.copy_(weights["hc_norm"])
        for name in ("input_mix_weight_down", "input_mix_weight_up", "block_inject_weight"):
            lin, w = getattr(hc, name), weights[name]
            if kind == "f32":
                lin.weight.copy_(w)
            elif kind == "bf16":
                lin.load_weight("weight", w.to(torch.bfloat16))
            else:
                raw = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
                lin.load_weight("weight", GGUFTensor(GGMLQuantizationType.Q8_0, torch.from_numpy(raw), tuple(w.shape)))
            if gguf:
                lin.quant_method.process_weights_after_loading(lin)
    return hc


CLOCK = time.thread_time if os.environ.get("CPU_TIME") else time.perf_counter  # CPU_TIME=1: this thread's CPU


def timed(fn, X) -> float:
    t0 = CLOCK()
    fn(X)
    return (CLOCK() - t0) * 1e3


g = torch.Generator().manual_seed(0)
weights = {
    "hc_norm": torch.randn(N * H, generator=g) * 0.1,
    "input_mix_weight_down": torch.randn(L, N * H, generator=g) / (N * H) ** 0.5,
    "input_mix_weight_up": torch.randn(N * H, L, generator=g) / L**0.5,
    "block_inject_weight": torch.randn(N, N * H, generator=g) / (N * H) ** 0.5,
}
print(f"H={H} lowrank={L} streams={N} threads={torch.get_num_threads()} (ms, medians of {REPS})")
with torch.inference_mode():
    for kind in KINDS:
        ref, ker = mixer(kind, False, weights), mixer(kind, True, weights)
        path = "fused" if ker.plain_weights() is not None else "split"
        for T in ROWS:
            X = torch.randn(T, N * H, generator=g) * 2
            a, b = ref(X), ker(X)
            err = max((a[0] - b[0]).abs().max().item(), (a[1] - b[1]).abs().max().item())
            ts, tk = [], []
            for _ in range(REPS if T < 1000 else max(3, REPS // 5)):
                ts.append(timed(ref, X))
                tk.append(timed(ker, X))
            use = path if path == "split" or T <= cpu_hc_mixer.FUSED_MAX_ROWS else "split"
            s, k = float(np.median(ts)), float(np.median(tk))
            print(f"{kind:5s} rows={T:5d} torch {s:8.3f}  kernel {k:8.3f} ({use})  x{s / k:5.2f}  max|diff| {err:.1e}")
