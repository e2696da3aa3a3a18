"""Second copies of a model's weights for the steps their kernel serves badly (CPU).

  int8 decode copy  a dense model (e.g. a dequantized GGUF in bf16) gets an int8 weight-only copy
                    of each Linear and the LM head for decode-sized steps: oneDNN's bf16 GEMV with
                    a few rows reads the weight at a fraction of memory bandwidth, torch's int8
                    kernel ~2.4x faster (symmetric per output row: about bf16's own precision).
  dense copy        packed int4 weights (GGUF, AWQ) get a dense copy in the run dtype for steps of
                    many rows (prefill, batched decode), where the packed kernel, which reads the
                    weight once per row, loses to a dense GEMM. Layers whose kernel wins at every
                    row count (the tiled GEMV's AVX2 build, its int8-activation path) get none.

Which copy a step uses, by its row count, is ember.quant.gemm_dispatch's (with the wrappers
installed here); whether to make a copy at all is the engine's start-up decision
(ember.engine.startup.weights). The measurements behind both are in docs/tuning.md.
"""

from __future__ import annotations

import torch
from torch import nn

from ember.layers.embedding import LMHead
from ember.layers.linear import DenseMethod, LinearBase
from ember.quant.gemm_dispatch import DenseCopyHeadMethod, DenseCopyMethod, Int8DecodeLMHead, Int8DecodeMethod


def enable_int8_decode(model: nn.Module) -> int:
    """Give every dense Linear and the LM head an int8 decode copy. Returns the extra bytes."""
    extra = 0
    for module in list(model.modules()):
        if isinstance(module, LinearBase) and type(module.quant_method) is DenseMethod:
            module.quant_method = Int8DecodeMethod()
            module.quant_method.process_weights_after_loading(module)
            extra += (
                module.weight_int8.numel() + module.weight_int8_scale.numel() * module.weight_int8_scale.element_size()
            )
    if isinstance(getattr(model, "lm_head", None), LMHead):
        model.lm_head = Int8DecodeLMHead(model.lm_head)
        extra += model.lm_head.weight_int8.numel()
    return extra


def _copy_helps(module: nn.Module) -> bool:
    """False where every part of the layer (or LM head) runs its kernel at any row count."""
    parts = (
        [getattr(module.quant_method, "part", None)]
        if isinstance(module, LMHead)
        else getattr(module, "gguf_parts", [])
    )
    return not (parts and all(getattr(p, "kernel_at_any_rows", False) for p in parts))


def packed_layers(model: nn.Module, helped: bool = True, head: bool = True) -> list[nn.Module]:
    """The Linears and the LM head whose method can make a dense copy (packed GGUF, AWQ) that
    would serve some steps (helped=False: those that run their kernel at any row count instead).
    head=False leaves the LM head out (the engine's default: see enable_dense_copy)."""
    found = [m for m in model.modules() if isinstance(m, LinearBase) and hasattr(m.quant_method, "dense_weight")]
    lm_head = getattr(model, "lm_head", None)
    if head and isinstance(lm_head, LMHead) and hasattr(lm_head.quant_method, "dense_weight"):
        found.append(lm_head)
    return [m for m in found if _copy_helps(m) == helped]


def dense_copy_bytes(model: nn.Module, dtype: torch.dtype, head: bool = True) -> int:
    """An upper bound of what enable_dense_copy adds (layers already dense add nothing)."""
    return (
        sum(
            m.vocab_size * m.quant_method.shape[1] if isinstance(m, LMHead) else m.in_features * m.out_features
            for m in packed_layers(model, head=head)
        )
        * dtype.itemsize
    )


def enable_dense_copy(model: nn.Module, dtype: torch.dtype, head: bool = True) -> int:
    """Give every packed Linear (GGUF, AWQ) and, with `head`, a packed LM head a dense copy in `dtype`.
    Returns the bytes added. The head's rows are the sampled sequences only (a prefill's last token),
    so its copy serves few steps, and it is the biggest copy (a 248K-vocab tied head: 485 MiB in bf16
    beside 303 MiB packed): the engine leaves it out unless --int4-dense-copy asks for it."""
    extra = 0
    for module in packed_layers(model, head=head):
        method = module.quant_method
        w = method.dense_weight(dtype) if isinstance(module, LMHead) else method.dense_weight(module)
        if w is None:
            continue
        w = w.to(dtype).contiguous()
        module.register_buffer("weight_dense", w, persistent=False)
        module.quant_method = DenseCopyHeadMethod(method, w) if isinstance(module, LMHead) else DenseCopyMethod(method)
        extra += w.nbytes
    return extra
