"""RMSNorm (+ residual add; plain or zero-centred), Gated DeltaNet's gated output norm, SiLU(gate) * up
and the rotary embedding on bf16 CPU rows, one pass each (cpu_fused_elementwise.cpp).

Why: eager torch runs RMSNorm with its residual add as six kernels (add, float, rms_norm's
pow / mean / mul, cast, weight mul) and silu_and_mul as two over strided halves, each a trip
through memory; in a 2048-token prefill chunk the rows are past L2. Measured on 2 Zen4 cores,
a throughput-bench prefill step of the default model (30 layers): see benchmarks/cpu.md, Levers.
The rotary embedding ran as 7 torch ops per tensor (4 products, a sub, an add, a cat), ~14 per
layer and step. Numerics are the eager ops' roundings op for op (bf16 after the add, after the
norm, after the weight; bf16 after SiLU, after the product; bf16 after each rotary product and
sum), so outputs match them but for rare 1-ulp bf16 differences (float32 sum order, a 2-ulp
exp); the rotary embedding matches bit for bit.

They run where x is bf16 on CPU with AVX-512 and the kernel built (~8 s once per machine, like
the attention kernel), and not inside torch.compile: inductor fuses these ops itself there.
Whether a model uses them at all is its CpuKernels' (the engine's --cpu-fused-elementwise): the
layers that can (RMSNorm, SiluAndMul, the rotary embedding) keep that choice from when they were
built and ask applies() per call only whether these tensors fit.
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build
from ember.kernels.tracing import tracing


def _fake_norm(x, residual, weight, eps, zero_centered):
    return torch.empty_like(x), (torch.empty_like(x) if residual is not None else x.new_empty((0,)))


FAKES = {
    "ember_cpu::rms_norm_bf16": _fake_norm,
    "ember_cpu::gated_rms_norm_bf16": lambda o, z, weight, eps: o.new_empty((o.shape[0], o.shape[1] * o.shape[2])),
    "ember_cpu::silu_and_mul_bf16": lambda x: x.new_empty((x.shape[0], x.shape[1] // 2)),
    "ember_cpu::rotary_bf16": lambda x, cos, sin: x.new_empty(x.shape),
}


def available() -> bool:
    """The ops can run here (AVX-512; loaded, built once first where they were not built at install)."""
    return build("cpu_fused_elementwise.cpp", fakes=FAKES) is not None


def applies(x: torch.Tensor) -> bool:
    """x [T, H] is a case for the fused ops: bf16 rows on CPU, outside torch.compile, kernel built."""
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.stride(-1) == 1
        and not tracing(x)
        and available()
    )


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centered: bool = False
):
    """norm(x) when residual is None; else (norm(x + residual), x + residual). Call where applies(x),
    with a bf16 weight (the op checks it). zero_centered: the weight is stored as w - 1, and multiplies
    as (1 + w) in float32 before the one rounding (Qwen3-Next / Qwen3.5's norm)."""
    out, total = torch.ops.ember_cpu.rms_norm_bf16(x, residual, weight, eps, zero_centered)
    return out if residual is None else (out, total)


def applies_gated(o: torch.Tensor, z: torch.Tensor) -> bool:
    """o [T, H, D] contiguous and z [T, H, D] with each row's heads contiguous (a view of the qkvz
    projection), both bf16 on CPU, outside torch.compile, kernel built."""
    return (
        o.dtype == z.dtype == torch.bfloat16
        and o.device.type == "cpu"
        and o.dim() == 3
        and o.is_contiguous()
        and z.shape == o.shape
        and z.stride(2) == 1
        and z.stride(1) == o.shape[2]
        and not tracing(o)
        and available()
    )


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm per head, bf16(bf16(w * bf16(rms(o))) * silu(z)) -> [T, H * D].
    Call where applies_gated(o, z), with a bf16 weight [D]."""
    return torch.ops.ember_cpu.gated_rms_norm_bf16(o, z, weight, eps)


def applies_rotary(x: torch.Tensor, cos: torch.Tensor) -> bool:
    """x [T, H, D] bf16 with each row's heads contiguous (q or k, a view of the qkv output) and bf16
    cos, outside torch.compile, kernel built."""
    return (
        x.dtype == torch.bfloat16
        and cos.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.stride(-1) == 1
        and x.stride(1) == x.shape[-1]
        and cos.dim() == 2
        and not tracing(x)
        and available()
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's bf16 roundings in one pass; call where applies_rotary(x, cos)."""
    return torch.ops.ember_cpu.rotary_bf16(x, cos.contiguous(), sin.contiguous())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]. Call where applies(x)."""
    return torch.ops.ember_cpu.silu_and_mul_bf16(x)
