"""A GGUF matrix kept as the file's own blocks and run by the block GEMV (ember.kernels.cpu_block_gemv).

The types with no tiled or int4 form -- Q2_K, Q3_K, IQ4_NL, IQ4_XS and the grid-coded IQ types, which the
Q2_K / IQ files users run (unsloth's UD-IQ1_S, UD-Q2_K_XL, bartowski's IQ4_XS) mix with Q4_K / Q6_K / Q8_0 --
were dequantized to dense float at load, 4-16x their bytes. A BlockPart holds the blocks as the file has them
(0.2-0.56 B a weight) and multiplies them in place: x is rounded to int8 per block as llama.cpp rounds it, and
each row's dot is integer sums inside (sub-)blocks, scaled in float32 per block. Lookups (an embedding, the
LM head's refined candidates) dequantize only their rows, exactly gguf-py's values. Q4_K / Q6_K / Q8_0 keep
their tiled parts in dense layers (faster there: docs/tuning.md), though the kernel runs them too (MoE experts
read from the file's map: block_moe).

The kernel serves every row count (no dense copy for prefill: the copy would be the 4-16x this part saves).
Where the kernel cannot run (another device, --no-cpu-block-gemv) these types stay dense, as before.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as T

from ember.kernels import cpu_block_gemv
from ember.kernels.cpu_kernels import CpuKernels

# The types a packed GGUF matrix takes a BlockPart for (the others have a faster layout of their own).
BLOCK_TYPES = (T.Q2_K, T.Q3_K, T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M)
BLOCK_TYPE_NAMES = tuple(t.name for t in BLOCK_TYPES)


def usable(qtype, device, kernels: CpuKernels | None = None) -> bool:
    """Whether a matrix of qtype on device runs as a BlockPart: CPU, --cpu-block-gemv, and the kernel (built
    here on first use where the install did not) has the type."""
    return (
        torch.device(device).type == "cpu" and (kernels or CpuKernels()).block_gemv and cpu_block_gemv.supports(qtype)
    )


class BlockPart:
    """The raw blocks uint8 [N, row_bytes] of one ggml type (`raw`: a copy of the file's rows, or a view of
    its map), K weights a row. A gguf_quant.PackedPart by its methods (not by class: gguf_quant imports this
    module)."""

    kernel_at_any_rows = True  # a dense copy would only cost the memory this part saves

    def __init__(self, raw: torch.Tensor, qtype, K: int):
        self.raw, self.qtype, self.N, self.K = raw, T(qtype), raw.shape[0], K

    def _gemm(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        x2 = x.reshape(-1, self.K)
        if x2.dtype not in (torch.float32, torch.bfloat16):
            x2 = x2.float()
        y = cpu_block_gemv.gemm(x2.contiguous(), self.raw, self.qtype, float_out)
        return y.reshape(*x.shape[:-1], self.N)

    def linear(self, x):
        y = self._gemm(x, float_out=False)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def linear_float(self, x):
        return self._gemm(x, float_out=True)

    def precise_logits(self, x):
        # float32 x is rounded to int8 per block here as in every layer before the head (llama.cpp's rounding
        # too): refining the head's top candidates in float32 would not make them an exact model's
        return x.dtype == torch.float32

    def rows(self, ids):
        return cpu_block_gemv.dequant_rows(self.raw.index_select(0, ids.reshape(-1)), self.qtype)

    def dequantize(self):
        return cpu_block_gemv.dequant_rows(self.raw, self.qtype)

    def buffers(self):
        return [self.raw]
