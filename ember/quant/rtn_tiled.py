"""Round-to-nearest 8-bit codes for a module's dense Linears (and its own LM head), run by the
tiled CPU GEMV kernel (ember.kernels.cpu_tiled_gemv) through the GGUF loader's TiledPart.

Used for draft weights (an MTP layer) on CPUs where the kernel runs: bf16 layers on AVX-512 BF16
(in place of rtn_int4), float32 layers on AVX2 (the default model's MTP layer: 21 MB fewer bytes
read a draft step than in dense float32). A draft step reads its weights for one row, so bytes
are its cost, but so is how close its drafts stay to the bf16 layer's: on the default model, the
engine's position-1 acceptance was 0.608 with bf16 draft weights and 0.582 with group-32 int4
(24 held-out generations). 8-bit codes keep the
drafts of the bf16 layer at 8 of its 15.5 MB, and the tiled kernel reads them faster than
torch's int4 kernel reads int4 (cpu_tiled_gemv.py), so a draft step costs about the same.

Asymmetric per group of 32 input columns (rtn_int4.rtn_affine with 8 bits): scale =
(max - min) / 255, offset = min, q = round((w - min) / scale) in 0..255.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.kernels import cpu_tiled_gemv as tiled_gemv
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.linear import DenseMethod, LinearBase, QuantMethod
from ember.quant.gguf_quant import TiledPart
from ember.quant.rtn_int4 import rtn_affine

BITS = 8


def usable(kernels: CpuKernels | None = None) -> bool:
    """Whether the kernel runs here (for layers in its dtype: bf16 on AVX-512 BF16, float32 on
    AVX2), with a compiler (built on the first call), and the model's kernels allow it
    (--cpu-tiled-gemv)."""
    dtype = tiled_gemv.x_dtype()
    return dtype is not None and TiledPart.usable(dtype, "cpu", kernels)


def _pack(module: nn.Module, w: torch.Tensor, kernels: CpuKernels) -> int:
    """module.tiled_part for w [N, K]; its tensors also registered as the module's buffers (they count
    in its bytes). Returns those bytes."""
    part = TiledPart(*rtn_affine(w, tiled_gemv.GROUP, BITS), BITS, int8_activations=kernels.int8_activations)
    module.tiled_part = part
    for name, t in zip(("tiled_codes", "tiled_scale", "tiled_offset"), part.buffers()):
        module.register_buffer(name, t)
    return sum(t.nbytes for t in part.buffers())


class RTNTiledMethod(QuantMethod):
    """A Linear whose dense weight was replaced by 8-bit tiles after loading."""

    def apply(self, layer, x, bias=None):
        y = layer.tiled_part.linear(x)
        return y if bias is None else y + bias


class RTNTiledHead:
    """LMHead.quant_method for an untied head packed to 8-bit tiles: float32 logits."""

    def __init__(self, part: TiledPart):
        self.part = part

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.part.linear_float(hidden)


def pack_module_tiled(module: nn.Module, kernels: CpuKernels | None = None) -> int:
    """Repack every dense Linear (and untied LMHead) under `module` in the kernel's dtype (bf16 or
    float32: tiled_gemv.x_dtype()) whose input size is a multiple of 32, on CPU. Returns the bytes
    saved; 0 where the kernel is not usable(kernels)."""
    from ember.layers.embedding import LMHead

    if not usable(kernels):
        return 0
    saved = 0
    for sub in module.modules():
        dense_linear = isinstance(sub, LinearBase) and isinstance(sub.quant_method, DenseMethod)
        own_head = (
            isinstance(sub, LMHead) and not sub.tied and sub.quant_method is None and getattr(sub, "tp_size", 1) == 1
        )
        if not (dense_linear or own_head) or not _packable(sub.weight):
            continue
        w = sub.weight
        del sub.weight
        saved += w.numel() * w.element_size() - _pack(sub, w.data, kernels or CpuKernels())
        sub.quant_method = RTNTiledMethod() if dense_linear else RTNTiledHead(sub.tiled_part)
    return saved


def pack_experts_tiled(module: nn.Module, kernels: CpuKernels | None = None) -> int:
    """Repack every dense stacked-experts storage under `module` (ember.layers.moe.Experts: a MoE draft layer,
    qwen4_exp's MTP) as GGUFExperts whose experts are 8-bit tiles, each expert's gate;up and down one TiledPart,
    run by the tiled GEMV for the experts a row routes to. A draft row reads its top-k experts: in float32 on
    AVX2 the bench model's 10 of 128 took 9.1 ms a step, in tiles 4.4 ms, and the layer's 128 experts held
    604 MB (the release's 512 of 2048 x 640: 8 GB) instead of 160 MB. Returns the bytes saved (0 where the
    kernel is not usable(kernels))."""
    from ember.layers.moe import Experts
    from ember.quant.gguf_quant import GGUFExperts, register_parts

    if not usable(kernels):
        return 0
    kernels = kernels or CpuKernels()
    saved = 0
    for parent in list(module.modules()):
        experts = getattr(parent, "experts", None)
        if not isinstance(experts, Experts) or not all(_packable(w[0]) for w in (experts.w13, experts.w2)):
            continue
        E, H, I = experts.num_experts, experts.w2.shape[1], experts.intermediate_size
        packed = GGUFExperts(E, H, I, experts.w13.dtype, experts.w13.device, kernels)
        for e in range(E):
            for parts, name, w in ((packed.parts13, "w13", experts.w13[e]), (packed.parts2, "w2", experts.w2[e])):
                part = TiledPart(*rtn_affine(w.data, tiled_gemv.GROUP, BITS), BITS, kernels.int8_activations)
                parts.append([part])
                register_parts(packed, parts[-1], f"{name}_{e}")
        saved += sum(w.nbytes for w in (experts.w13, experts.w2)) - sum(b.nbytes for b in packed.buffers())
        parent.experts = packed
    return saved


def _packable(w: torch.Tensor) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype == tiled_gemv.x_dtype()
        and w.dim() == 2
        and w.shape[1] % tiled_gemv.GROUP == 0
    )
