"""A dense copy of packed int4 weights for CPU steps with many rows (prefill, batched decode).

torch's CPU int4 kernel reads the packed weight once per row of x: it wins while a step is a
few rows (batch-1 decode, a speculative verify) because decode is bandwidth-bound, and loses
beyond. Measured on 2 Zen4 cores, bf16, int4 kernel vs dense GEMM (us):
    rows         1     4     8    16    64   128
    3072x576    25    46    84   164   669  1304   (kernel)
                66    69    91   109   279   492   (dense)
Without a copy, a step above int4_cpu.KERNEL_MAX_ROWS rows dequantizes every layer first
(~72 ms per step for the default model) and steps in between pay the kernel's per-row cost
(a 64-sequence decode step: 2.4x the dense GEMM; the Q8_0 LM head ~21 ms against ~5 ms). With
the copy, steps of DENSE_MIN_ROWS rows or more run dense GEMMs over it. The price is the
memory: the default model's 102 MB of packed weights gain 269 MB of bf16.

Where every part of a layer is the tiled GEMV's AVX2 build (float32 x held as int16 steps,
code sums with vpmaddwd), the kernel beats the float32 GEMM at every row count (its many-row
path widens the codes once and reuses them), so such a layer gets no copy at all. Measured on
2 Zen3 cores, float32, 3072x576 4-bit, tiled kernel vs MKL's dense GEMM (ms):
    rows         16     64    512   2048
    tiled     0.288  1.016  8.022   33.4
    dense     0.612  1.607  10.98   39.7

Likewise where the tiled GEMV has its int8-activation path (AVX-512 VNNI, --cpu-int8-activations,
the default there): steps of many rows run it on the packed codes, ~1.2-2x oneDNN's bf16 GEMM over
a copy (cpu_tiled_gemv.py has the figures), so the copy is left out.

This is the mirror image of int8_decode (a dense model plus an int8 copy for decode).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.layers.embedding import LMHead
from ember.layers.linear import LinearBase, QuantMethod

DENSE_MIN_ROWS = 9  # crossover measured between 8 and 16 rows (table above)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1]


def _copy_helps(module: nn.Module) -> bool:
    """False where every part of the layer (or LM head) runs its kernel at any row count."""
    parts = [getattr(module.quant_method, "part", None)] if isinstance(module, LMHead) else getattr(module, "gguf_parts", [])
    return not (parts and all(getattr(p, "kernel_at_any_rows", False) for p in parts))


class DenseCopyMethod(QuantMethod):
    """Wraps a packed linear method: few rows go to it, many to F.linear over layer.weight_dense."""

    def __init__(self, inner: QuantMethod):
        self.inner = inner

    def apply(self, layer, x, bias=None):
        if _rows(x) >= DENSE_MIN_ROWS:
            return F.linear(x, layer.weight_dense, bias)
        return self.inner.apply(layer, x, bias)


class DenseCopyHeadMethod:
    """The same for a packed LM head; the tied embedding keeps the packed method for lookups."""

    def __init__(self, inner, dense: torch.Tensor):
        self.inner, self.dense = inner, dense

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.embed(ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if _rows(hidden) >= DENSE_MIN_ROWS:
            y = F.linear(hidden, self.dense).float()
            return y if hidden.dtype == torch.float32 else self.inner.refine(y, hidden)  # float32: exact already
        return self.inner.logits(hidden)


def packed_layers(model: nn.Module, helped: bool = True) -> list[nn.Module]:
    """The Linears and the LM head whose method can make a dense copy (packed GGUF, AWQ) that
    would serve some steps (helped=False: those that run their kernel at any row count instead)."""
    found = [m for m in model.modules() if isinstance(m, LinearBase) and hasattr(m.quant_method, "dense_weight")]
    head = getattr(model, "lm_head", None)
    if isinstance(head, LMHead) and hasattr(head.quant_method, "dense_weight"):
        found.append(head)
    return [m for m in found if _copy_helps(m) == helped]


def dense_copy_bytes(model: nn.Module, dtype: torch.dtype) -> int:
    """An upper bound of what enable_dense_copy adds (layers already dense add nothing)."""
    return sum(m.vocab_size * m.quant_method.shape[1] if isinstance(m, LMHead) else m.in_features * m.out_features
               for m in packed_layers(model)) * dtype.itemsize


def enable_dense_copy(model: nn.Module, dtype: torch.dtype) -> int:
    """Give every packed Linear (GGUF, AWQ) and a packed LM head a dense copy in `dtype`.
    Returns the bytes added."""
    extra = 0
    for module in packed_layers(model):
        method = module.quant_method
        w = method.dense_weight() if isinstance(module, LMHead) else method.dense_weight(module)
        if w is None:
            continue
        w = w.to(dtype).contiguous()
        module.register_buffer("weight_dense", w, persistent=False)
        module.quant_method = DenseCopyHeadMethod(method, w) if isinstance(module, LMHead) else DenseCopyMethod(method)
        extra += w.nbytes
    return extra
