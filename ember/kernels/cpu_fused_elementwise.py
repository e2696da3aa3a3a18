"""RMSNorm (+ residual add) and SiLU(gate) * up on bf16 CPU rows, one pass each (cpu_fused_elementwise.cpp).

Why: eager torch runs RMSNorm with its residual add as six kernels (add, float, rms_norm's
pow / mean / mul, cast, weight mul) and silu_and_mul as two over strided halves, each a trip
through memory; in a 2048-token prefill chunk the rows are past L2. Measured on 2 Zen4 cores,
a throughput-bench prefill step of the default model (30 layers): see benchmarks/cpu.md, Levers.
Numerics are the eager ops' roundings op for op (bf16 after the add, after the norm, after the
weight; bf16 after SiLU, after the product), so outputs match them but for rare 1-ulp bf16
differences (float32 sum order, a 2-ulp exp).

They run where x is bf16 on CPU with AVX-512 and the kernel built (~20 s once per machine, like
the attention kernel), and not inside torch.compile: inductor fuses these ops itself there.
set_enabled(False) (the engine's --no-cpu-fused-elementwise) keeps the torch ops.
"""
from __future__ import annotations

import torch

from ember.kernels.cpp_build import build, has_cpu_flags

enabled = True


def set_enabled(on: bool) -> None:
    global enabled
    enabled = on


def _fake_norm(x, residual, weight, eps):
    return torch.empty_like(x), (torch.empty_like(x) if residual is not None else x.new_empty((0,)))


FAKES = {"ember_cpu::rms_norm_bf16": _fake_norm,
         "ember_cpu::silu_and_mul_bf16": lambda x: x.new_empty((x.shape[0], x.shape[1] // 2))}


def available() -> bool:
    """The ops can run here (builds them on the first call)."""
    return (has_cpu_flags("avx512f", "avx512bw")
            and build("cpu_fused_elementwise.cpp", "CPU fused elementwise kernels", python_module=False,
                      fakes=FAKES) is not None)


def applies(x: torch.Tensor) -> bool:
    """x [T, H] is a case for the fused ops: bf16 rows on CPU, outside torch.compile, kernel built."""
    return (enabled and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(-1) == 1
            and not torch.compiler.is_compiling() and available())


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """norm(x) when residual is None; else (norm(x + residual), x + residual). Call where applies(x),
    with a bf16 weight (the op checks it)."""
    out, total = torch.ops.ember_cpu.rms_norm_bf16(x, residual, weight, eps)
    return out if residual is None else (out, total)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]. Call where applies(x)."""
    return torch.ops.ember_cpu.silu_and_mul_bf16(x)
