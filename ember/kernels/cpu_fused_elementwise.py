"""RMSNorm (+ residual add; plain or zero-centred), Gated DeltaNet's gated output norm, SiLU(gate) * up
and the rotary embedding on bf16 or float32 CPU rows, one pass each (cpu_fused_elementwise.cpp).

Why: eager torch runs RMSNorm with its residual add as six kernels (add, float, rms_norm's
pow / mean / mul, cast, weight mul; four in float32) and silu_and_mul as two over strided halves, each
a trip through memory; in a 2048-token prefill chunk the rows are past L2. Measured on 2 Zen4 cores,
a throughput-bench prefill step of the default model (30 layers): see benchmarks/cpu.md, Levers.
The rotary embedding ran as 7 torch ops per tensor (4 products, a sub, an add, a cat), ~14 per
layer and step. Numerics are the eager ops' roundings op for op (in bf16: after the add, after the
norm, after the weight; after SiLU, after the product; after each rotary product and sum; in float32
every product is rounded too, never fused into an FMA), so outputs match them but for rare 1-ulp
differences (float32 sum order, a 2-ulp exp); the rotary embedding matches bit for bit.

One build per machine: AVX-512 (16 lanes; F + BW for bf16's masked loads) or AVX2 + FMA (8 lanes:
Zen2/3, Haswell on, where `--dtype auto` means float32), both taking bf16 and float32 rows (DTYPES);
docs/tuning.md, "CPU kernels", has each build's figures against the torch ops. They run where the
kernel is built (~8 s once per machine, like the attention kernel), and not inside torch.compile:
inductor fuses these ops itself there. Whether a model uses them at all is its CpuKernels' (the
engine's --cpu-fused-elementwise): the layers that can (RMSNorm, SiluAndMul, the rotary embedding,
GatedRMSNorm) keep that choice from when they were built and ask applies() per call only whether
these tensors fit.
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build
from ember.kernels.tracing import tracing

SOURCE = "cpu_fused_elementwise.cpp"
DTYPES = (torch.bfloat16, torch.float32)  # of the rows (and weights, cos / sin: x's dtype) the ops take


def _fake_norm(x, residual, weight, eps, zero_centered):
    return torch.empty_like(x), (torch.empty_like(x) if residual is not None else x.new_empty((0,)))


FAKES = {
    "ember_cpu::rms_norm": _fake_norm,
    "ember_cpu::gated_rms_norm": lambda o, z, weight, eps: o.new_empty((o.shape[0], o.shape[1] * o.shape[2])),
    "ember_cpu::silu_and_mul": lambda x: x.new_empty((x.shape[0], x.shape[1] // 2)),
    "ember_cpu::rotary": lambda x, cos, sin: x.new_empty(x.shape),
}


def available() -> bool:
    """The ops can run here (AVX-512 or AVX2 + FMA; loaded, built once first where they were not built
    at install)."""
    return build(SOURCE, fakes=FAKES) is not None


def needs_grad(*tensors: torch.Tensor) -> bool:
    """A forward autograd records (MTP training: trained weights, or inputs that carry a gradient): the ops
    have no backward, so such a forward keeps the torch ops. `params`: the layer's weights beside x."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def applies(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """x [T, H] is a case for the fused ops: bf16 or float32 rows on CPU, outside torch.compile and autograd (needs_grad), kernel
    built."""
    return (
        x.dtype in DTYPES
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.stride(-1) == 1
        and not needs_grad(x, *params)
        and not tracing(x)
        and available()
    )


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, zero_centered: bool = False
):
    """norm(x) when residual is None; else (norm(x + residual), x + residual). Call where applies(x),
    with weight (and residual) in x's dtype (the op checks it). zero_centered: the weight is stored as
    w - 1, and multiplies as (1 + w) in float32 before the one rounding (Qwen3-Next / Qwen3.5's norm)."""
    out, total = torch.ops.ember_cpu.rms_norm(x, residual, weight, eps, zero_centered)
    return out if residual is None else (out, total)


def applies_gated(o: torch.Tensor, z: torch.Tensor, *params: torch.Tensor) -> bool:
    """o [T, H, D] contiguous and z [T, H, D] with each row's heads contiguous (a view of the qkvz
    projection), both bf16 or both float32 on CPU, outside torch.compile and autograd (needs_grad), kernel built."""
    return (
        o.dtype in DTYPES
        and z.dtype == o.dtype
        and o.device.type == "cpu"
        and o.dim() == 3
        and o.is_contiguous()
        and z.shape == o.shape
        and z.stride(2) == 1
        and z.stride(1) == o.shape[2]
        and not needs_grad(o, z, *params)
        and not tracing(o)
        and available()
    )


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated DeltaNet's output norm per head, T(T(w * T(rms(o))) * silu(z)) in o's dtype T -> [T, H * D].
    Call where applies_gated(o, z), with a weight [D] in o's dtype."""
    return torch.ops.ember_cpu.gated_rms_norm(o, z, weight, eps)


def applies_rotary(x: torch.Tensor, cos: torch.Tensor, *params: torch.Tensor) -> bool:
    """x [T, H, D] bf16 or float32 with each row's heads contiguous (q or k, a view of the qkv output)
    and cos in x's dtype, outside torch.compile and autograd (needs_grad), kernel built."""
    return (
        x.dtype in DTYPES
        and cos.dtype == x.dtype
        and x.device.type == "cpu"
        and x.dim() == 3
        and x.stride(-1) == 1
        and x.stride(1) == x.shape[-1]
        and cos.dim() == 2
        and not needs_grad(x, *params)
        and not tracing(x)
        and available()
    )


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's roundings in one pass; call where applies_rotary(x, cos)."""
    return torch.ops.ember_cpu.rotary(x, cos.contiguous(), sin.contiguous())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I]. Call where applies(x)."""
    return torch.ops.ember_cpu.silu_and_mul(x)


def lanes() -> int:
    """float32 lanes of the build loaded here: 16 (AVX-512) or 8 (AVX2). Call where available()."""
    return torch.ops.ember_cpu.fused_elementwise_lanes()
