"""Int8 decode weights for CPU: a weight-only int8 copy beside the dense weight, used for
decode-sized batches.

Why: on CPU, oneDNN's bf16 GEMV with one to a few rows reads the weight at a fraction of
memory bandwidth (measured: a 3072x576 bf16 linear at M=1 is ~2.4x slower than torch's
int8 weight-only kernel, the 49152x576 LM head ~2.4x), and batch-1 decode is nothing but
GEMVs. For larger batches (prefill chunks, many decodes) the int8 kernel does not reuse the
weight across rows and loses to the dense GEMM, so both copies are kept and the row count
picks one. The int8 copy is symmetric per output row (scale = max|w| / 127): about the
precision of bf16 itself for these weights.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.embedding import LMHead
from ember.layers.linear import DenseMethod, LinearBase

# Up to this many rows use the int8 GEMV kernel; measured crossover on 2 Zen4 cores is ~16.
MAX_INT8_ROWS = 8


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scale [N] in w.dtype) with w ~= q * scale[:, None]."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


def int8_or_dense(x: torch.Tensor, weight: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    if x.dim() == 2 and x.shape[0] <= MAX_INT8_ROWS:
        y = torch._weight_int8pack_mm(x.contiguous(), w8, scale)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Int8DecodeMethod(DenseMethod):
    """DenseMethod plus an int8 copy taken after loading; apply() picks by row count."""

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        w8, scale = quantize_rows_int8(layer.weight.data)
        layer.register_buffer("weight_int8", w8, persistent=False)
        layer.register_buffer("weight_int8_scale", scale, persistent=False)

    def apply(self, layer, x, bias=None):
        return int8_or_dense(x, layer.weight, layer.weight_int8, layer.weight_int8_scale, bias)


class Int8DecodeLMHead(nn.Module):
    """Wraps an LMHead the same way (the head is the largest single GEMV of a small model)."""

    def __init__(self, head: LMHead):
        super().__init__()
        self.head = head
        w8, scale = quantize_rows_int8(head.weight.data)
        self.register_buffer("weight_int8", w8, persistent=False)
        self.register_buffer("weight_int8_scale", scale, persistent=False)

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    @property
    def vocab_size(self) -> int:  # read by whoever scores against the head (an MTP layer's loader)
        return self.head.vocab_size

    @property
    def tied(self) -> bool:
        return self.head.tied

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return int8_or_dense(hidden, self.head.weight, self.weight_int8, self.weight_int8_scale, None).float()


def enable_int8_decode(model: nn.Module) -> int:
    """Give every dense Linear and the LM head an int8 decode copy. Returns the extra bytes."""
    extra = 0
    for module in list(model.modules()):
        if isinstance(module, LinearBase) and type(module.quant_method) is DenseMethod:
            module.quant_method = Int8DecodeMethod()
            module.quant_method.process_weights_after_loading(module)
            extra += module.weight_int8.numel() + module.weight_int8_scale.numel() * module.weight_int8_scale.element_size()
    if isinstance(getattr(model, "lm_head", None), LMHead):
        model.lm_head = Int8DecodeLMHead(model.lm_head)
        extra += model.lm_head.weight_int8.numel()
    return extra
