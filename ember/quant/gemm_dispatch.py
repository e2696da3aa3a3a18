"""Which GEMM runs a weight, by the number of rows of x: every crossover in one place.

A kernel over packed (or int8-copied) weights reads the weight once per row of x: it wins while
a step has few rows (batch-1 decode, a speculative verify: bandwidth-bound) and loses to a dense
GEMM beyond, which reuses each weight across rows. Each method asks here instead of keeping its
own threshold. The measurements behind each crossover are in docs/tuning.md:

  int4_kernel      torch's CPU int4 kernel up to INT4_KERNEL_MAX_ROWS rows, then dequantize + a
                   dense GEMM
  q6k_kernel       Q6_K's 2K-wide int4 call (Q6KPart) up to Q6K_KERNEL_MAX_ROWS rows, then the bf16
                   weight rebuilt for a dense GEMM
  tiled_path       the tiled GEMV (4/8-bit tiles and Q6_K's): its int8-x path (AVX-512 VNNI) from
                   TILED_Q8_MIN_ROWS rows, else the GEMV up to the part's max_rows (None: every row
                   count, the AVX2 build), else a dense GEMM
  half_gemv        16-bit weights under float32 x (HalfPart): the kernel's GEMV up to
                   HALF_GEMV_MAX_ROWS rows, widened panels for torch's GEMM above
  dense_copy       a dense copy of packed weights from DENSE_COPY_MIN_ROWS rows
  int8_copy        an int8 copy of dense weights up to INT8_COPY_MAX_ROWS rows
  refine_logits    a low-precision LM head recomputes its top candidates in float32 up to
                   REFINE_MAX_ROWS rows
  awq_fused        AWQ on CUDA: the fused int4 GEMM below AWQ_DEQUANT_MIN_ROWS rows, then
                   dequantize + GEMM (vLLM's rule)

The copy wrappers (DenseCopyMethod, DenseCopyHeadMethod, Int8DecodeMethod, Int8DecodeLMHead)
are here too: all they add to the method they wrap is this choice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.embedding import LMHead
from ember.layers.linear import DenseMethod, LinearBase, QuantMethod

INT4_KERNEL_MAX_ROWS = 192
Q6K_KERNEL_MAX_ROWS = 40
TILED_Q8_MIN_ROWS = 5
HALF_GEMV_MAX_ROWS = 32
DENSE_COPY_MIN_ROWS = 9
INT8_COPY_MAX_ROWS = 8
REFINE_MAX_ROWS = INT4_KERNEL_MAX_ROWS
AWQ_DEQUANT_MIN_ROWS = 256


def rows(x: torch.Tensor) -> int:
    """Rows of x [..., K]: the step's tokens (or sequences) this GEMM serves."""
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def int4_kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and rows(x) <= INT4_KERNEL_MAX_ROWS


def q6k_kernel(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and rows(x) <= Q6K_KERNEL_MAX_ROWS


def tiled_path(x: torch.Tensor, x_dtype: torch.dtype, q8: bool, max_rows: int | None) -> str:
    """ "q8" (the int8-x path), "gemv" or "dense" for a tiled part: q8 = the part has the int8-x path;
    max_rows = the most rows its GEMV takes (None: any); x_dtype = the dtype its GEMV takes."""
    n = rows(x)
    if q8 and x.dtype == torch.bfloat16 and n >= TILED_Q8_MIN_ROWS:
        return "q8"
    if x.dtype == x_dtype and (max_rows is None or n <= max_rows):
        return "gemv"
    return "dense"


def dense_copy(x: torch.Tensor) -> bool:
    return rows(x) >= DENSE_COPY_MIN_ROWS


def int8_copy(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.shape[0] <= INT8_COPY_MAX_ROWS


def refine_logits(n: int) -> bool:
    return 0 < n <= REFINE_MAX_ROWS


def awq_fused(x: torch.Tensor) -> bool:
    return rows(x) < AWQ_DEQUANT_MIN_ROWS


# ---- a dense copy of packed weights (GGUF, AWQ) for many-row steps ----------------------------


class DenseCopyMethod(QuantMethod):
    """Wraps a packed linear method: few rows go to it, many to F.linear over layer.weight_dense."""

    def __init__(self, inner: QuantMethod):
        self.inner = inner

    def apply(self, layer, x, bias=None):
        if dense_copy(x):
            return F.linear(x, layer.weight_dense, bias)
        return self.inner.apply(layer, x, bias)


class DenseCopyHeadMethod:
    """The same for a packed LM head; the tied embedding keeps the packed method for lookups."""

    def __init__(self, inner, dense: torch.Tensor):
        self.inner, self.dense = inner, dense

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if dense_copy(hidden):
            y = F.linear(hidden, self.dense).float()
            return y if hidden.dtype == torch.float32 else self.inner.refine(y, hidden)  # float32: exact already
        return self.inner.logits(hidden)


# ---- an int8 copy of dense weights for decode-sized steps -------------------------------------


def int8_or_dense(
    x: torch.Tensor, weight: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if int8_copy(x):
        y = torch._weight_int8pack_mm(x.contiguous(), w8, scale)
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scale [N] in w.dtype) with w ~= q * scale[:, None]."""
    wf = w.float()
    scale = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(w.dtype)


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
