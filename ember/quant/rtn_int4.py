"""Round-to-nearest int4 for a module's dense Linears (and its own LM head) after loading.

Used for draft weights (an MTP layer) on CPU: a draft step is one decoder layer plus a head,
read from memory for a single row, so its cost is its weight bytes. In bf16 the default
model's MTP layer is 15.5 MB, about a sixth of the Q4_1 main model's bytes per step; group-32
int4 (torch's CPU int4 kernel, ember.quant.int4_cpu) cuts that to about a quarter. RTN changes
the drafts a little, never the output: the target verifies every draft.

Asymmetric per group of G input columns: scale = (max - min) / 15, offset = min,
q = round((w - min) / scale) in 0..15, so w ~= q * scale + offset (Int4Weight.from_affine).
"""

from __future__ import annotations

import torch
from torch import nn

from ember.layers.linear import DenseMethod, LinearBase, QuantMethod
from ember.quant.int4_cpu import Int4Weight

GROUP_SIZE = 32  # the kernel's smallest group: the closest fit to the dense weights


def rtn_affine(w: torch.Tensor, group_size: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (q [N, K] uint8 0..2^bits - 1, scale [N, K/G], offset [N, K/G]), all computed in float32."""
    N, K = w.shape
    top = 2**bits - 1
    g = w.float().view(N, K // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / top).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, top).to(torch.uint8)
    return q.view(N, K), scale, lo


def to_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    q, scale, offset = rtn_affine(w, group_size)
    return Int4Weight.from_affine(q, scale, offset, group_size, w.dtype)


class RTNInt4Method(QuantMethod):
    """A Linear whose dense weight was replaced by int4 buffers after loading."""

    def __init__(self, group_size: int):
        self.group_size = group_size

    def apply(self, layer, x, bias=None):
        w = Int4Weight(
            layer.int4_packed, layer.int4_scales_zeros, self.group_size, layer.out_features, layer.in_features
        )
        return w.linear(x, bias)


class RTNInt4Head:
    """LMHead.quant_method for an untied head packed to int4: logits = hidden @ W^T."""

    def __init__(self, w: Int4Weight):
        self.w = w

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.w.linear(hidden)


def pack_module_int4(module: nn.Module, group_size: int = GROUP_SIZE) -> int:
    """Repack every dense Linear (and untied LMHead) under `module` whose shape the kernel takes.
    CPU, bf16 weights only (the kernel is fast in bf16 alone). Returns the bytes saved."""
    from ember.layers.embedding import LMHead

    saved = 0
    for sub in module.modules():
        if isinstance(sub, LinearBase) and isinstance(sub.quant_method, DenseMethod):
            w = sub.weight
            if not _packable(w, group_size):
                continue
            packed = to_int4(w.data, group_size)
            del sub.weight
            sub.register_buffer("int4_packed", packed.packed)
            sub.register_buffer("int4_scales_zeros", packed.scales_zeros)
            sub.quant_method = RTNInt4Method(group_size)
            saved += w.numel() * w.element_size() - packed.nbytes
        elif isinstance(sub, LMHead) and not sub.tied and sub.quant_method is None:
            w = sub.weight
            if not _packable(w, group_size) or getattr(sub, "tp_size", 1) > 1:
                continue
            packed = to_int4(w.data, group_size)
            sub.quant_method = RTNInt4Head(packed)
            sub.register_buffer("int4_packed", packed.packed)  # counted with the module's buffers
            sub.register_buffer("int4_scales_zeros", packed.scales_zeros)
            del sub.weight
            saved += w.numel() * w.element_size() - packed.nbytes
    return saved


def _packable(w: torch.Tensor, group_size: int) -> bool:
    return (
        w.device.type == "cpu"
        and w.dtype == torch.bfloat16
        and w.dim() == 2
        and Int4Weight.supports(w.shape[0], w.shape[1], group_size)
    )
