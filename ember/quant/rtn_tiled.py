"""Round-to-nearest 8-bit codes for a module's dense Linears (and its own LM head), run by the
tiled CPU GEMV kernel (ember.kernels.cpu_tiled_gemv).

Used for draft weights (an MTP layer) on CPUs with AVX-512 BF16, in place of rtn_int4. A draft
step reads its weights for one row, so bytes are its cost, but so is how close its drafts stay
to the bf16 layer's: on the default model, the engine's position-1 acceptance was 0.608 with
bf16 draft weights and 0.582 with group-32 int4 (24 held-out generations). 8-bit codes keep the
drafts of the bf16 layer at 8 of its 15.5 MB, and the tiled kernel reads them faster than
torch's int4 kernel reads int4 (cpu_tiled_gemv.py), so a draft step costs about the same.

Asymmetric per group of 32 input columns: scale = (max - min) / 255, offset = min,
q = round((w - min) / scale) in 0..255, so w ~= q * scale + offset.
"""
from __future__ import annotations

import torch
from torch import nn

from ember.kernels import cpu_tiled_gemv as tiled_gemv
from ember.layers.linear import DenseMethod, LinearBase, QuantMethod
from ember.quant.int4_cpu import KERNEL_MAX_ROWS

BITS = 8


def rtn_affine8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (q [N, K] uint8 0..255, scale [N, K/32], offset [N, K/32]), computed in float32."""
    N, K = w.shape
    g = w.float().view(N, K // tiled_gemv.GROUP, tiled_gemv.GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 255).clamp_min(1e-8)
    q = ((g - lo[..., None]) / scale[..., None]).round_().clamp_(0, 255).to(torch.uint8)
    return q.view(N, K), scale, lo


def usable() -> bool:
    """Whether the kernel runs here: AVX-512 BF16, a compiler (built on the first call), and not
    turned off (--no-cpu-tiled-gemv)."""
    return tiled_gemv.enabled and tiled_gemv.available()


class _Tiles:
    """The kernel's (tiles, scale, offset) of one [N, K] weight, read from the module's buffers on
    every call (so .to() and state moves follow them)."""

    @staticmethod
    def register(module: nn.Module, w: torch.Tensor) -> int:
        q, scale, offset = rtn_affine8(w)
        tiles, s, o = tiled_gemv.pack(q, scale, offset, BITS)
        module.register_buffer("tiled_codes", tiles)
        module.register_buffer("tiled_scale", s)
        module.register_buffer("tiled_offset", o)
        module.tiled_n = w.shape[0]
        return tiles.nbytes + s.nbytes + o.nbytes

    @staticmethod
    def linear(module: nn.Module, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        N, K = module.tiled_n, x.shape[-1]
        x2 = x.reshape(-1, K)
        if x2.dtype == torch.bfloat16 and x2.shape[0] <= KERNEL_MAX_ROWS:
            y = tiled_gemv.gemv(x2.contiguous(), module.tiled_codes, module.tiled_scale, module.tiled_offset, BITS,
                                float_out)
        else:  # many rows (a prefill's fill): one dense GEMM over the weight rebuilt for this call
            w = tiled_gemv.dequantize(module.tiled_codes, module.tiled_scale, module.tiled_offset, BITS, x2.dtype, N)
            y = x2 @ w.t()
            y = y.float() if float_out else y
        return y[:, :N].reshape(*x.shape[:-1], N)


class RTNTiledMethod(QuantMethod):
    """A Linear whose dense weight was replaced by 8-bit tiles after loading."""

    def apply(self, layer, x, bias=None):
        y = _Tiles.linear(layer, x, float_out=False)
        return y if bias is None else y + bias


class RTNTiledHead:
    """LMHead.quant_method for an untied head packed to 8-bit tiles: float32 logits."""

    def __init__(self, module: nn.Module):
        self.module = module

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _Tiles.linear(self.module, hidden, float_out=True)


def pack_module_tiled(module: nn.Module) -> int:
    """Repack every dense bf16 Linear (and untied LMHead) under `module` whose input size is a
    multiple of 32, on CPU. Returns the bytes saved; 0 where the kernel is not usable()."""
    from ember.layers.embedding import LMHead

    if not usable():
        return 0
    saved = 0
    for sub in module.modules():
        dense_linear = isinstance(sub, LinearBase) and isinstance(sub.quant_method, DenseMethod)
        own_head = (isinstance(sub, LMHead) and not sub.tied and sub.quant_method is None
                    and getattr(sub, "tp_size", 1) == 1)
        if not (dense_linear or own_head) or not _packable(sub.weight):
            continue
        w = sub.weight
        del sub.weight
        saved += w.numel() * w.element_size() - _Tiles.register(sub, w.data)
        sub.quant_method = RTNTiledMethod() if dense_linear else RTNTiledHead(sub)
    return saved


def _packable(w: torch.Tensor) -> bool:
    return (w.device.type == "cpu" and w.dtype == torch.bfloat16 and w.dim() == 2
            and w.shape[1] % tiled_gemv.GROUP == 0)
