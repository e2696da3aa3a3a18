"""A Hugging Face checkpoint's bf16 / fp16 matrices kept 16-bit in a float32 CPU run (`--cpu-half-weights`).

A CPU without AVX512-BF16 runs float32 (ember.platform.resolve_dtype_name), and a dense model widened
its bf16 checkpoint to float32 at load: twice the file's bytes in RAM, and twice the bytes a decode step
reads. A BF16 GGUF already kept them 16-bit as HalfParts (ember.quant.gguf_quant: a C++ GEMV widens
them in registers, ember.kernels.cpu_half_gemv, the same float32 products). This config gives a
folder's matrices the same parts: the GGUF methods take plain torch tensors as well as GGUF blocks, so
every Linear, the MoE experts, the embedding and the LM head hold their 16-bit rows, and anything else
(norms, a float32 router) stays dense in float32.
"""

from __future__ import annotations

import torch

from ember.kernels.cpu_kernels import CpuKernels
from ember.quant.gguf_quant import GGUFConfig, HalfPart

HALF_DTYPES = ("bfloat16", "float16")


class HalfWeightsConfig(GGUFConfig):
    name = "half"


def half_weights_config(
    checkpoint_dtype: str | None, dtype: torch.dtype, device, kernels: CpuKernels | None, tp_size: int
) -> HalfWeightsConfig | None:
    """The config for a dense folder whose checkpoint dtype is `checkpoint_dtype`, run in `dtype` on
    `device`: HalfWeightsConfig where its matrices can stay 16-bit (HalfPart.usable: float32 on a CPU with
    the kernel, --cpu-half-weights), else None (dense). Not under tensor parallelism, whose Linears shard
    dense weights as they load."""
    if checkpoint_dtype not in HALF_DTYPES or tp_size != 1 or not HalfPart.usable(dtype, device, kernels):
        return None
    config = HalfWeightsConfig()
    config.kernels = kernels or CpuKernels()
    return config
