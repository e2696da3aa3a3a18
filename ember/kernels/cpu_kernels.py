"""CpuKernels: which of ember's C++ CPU kernels a model runs, chosen once, when it is built.

vLLM's CustomOp idea without the class hierarchy: a layer that has a fast CPU path (RMSNorm,
SiLU*up, the rotary embedding, the attention backend, a packed GGUF linear, Gated DeltaNet) is handed this
object when it is constructed and keeps the one boolean it needs; its forward then takes the
C++ kernel where the tensors fit it (e.g. bf16 or float32 rows on CPU, outside torch.compile) and the torch ops
otherwise. Nothing reads a module-level switch, so two engines with different --cpu-* flags can
live in one process, and building a layer cannot depend on what ran before.

`select` (the engine, and each tensor-parallel worker, at start) turns the --cpu-* flags into
one of these for the device and dtype, building (or loading) each kernel asked for right then, so
no request waits for a compiler and a kernel that cannot be built here is simply off.
`CpuKernels()` allows every kernel (each still checks it can run: the default for a layer built
outside the engine, as in the tests); `CpuKernels.none()` is the pure torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass(frozen=True)
class CpuKernels:
    paged_attention: bool = True  # fused paged attention for decodes and verifies (cpu_paged_attention)
    flash_attention: bool = True  # flash-style causal attention for bf16 / float32 prefill (cpu_causal_attention)
    fused_elementwise: bool = True  # RMSNorm, SiLU*up, RoPE in one pass each, bf16 / fp32 (cpu_fused_elementwise)
    tiled_gemv: bool = True  # GGUF 4/8-bit weights in the tiled GEMV's layout (cpu_tiled_gemv)
    int8_activations: bool = True  # the tiled GEMV's int8-x path for many-row steps (AVX-512 VNNI)
    half_weights: bool = True  # GGUF BF16 / F16 matrices kept 16-bit under float32 x (cpu_half_gemv)
    gated_delta_net: bool = True  # Gated DeltaNet conv + recurrence for decodes and verifies (cpu_gated_delta_net)
    qsa_attention: bool = True  # qwen4_exp's selected-block (QSA) attention, bf16 / fp32 KV (cpu_qsa_attention)
    qsa_scoring: bool = True  # qwen4_exp's QSA block scoring and top-k selection (cpu_qsa_scoring)
    hc_mixer: bool = True  # qwen4_exp's hyper-connection mixer, bf16 / fp32 (cpu_hc_mixer)
    fp8_gemv: bool = True  # an FP8 checkpoint's block-scaled e4m3 weights kept fp8 (cpu_fp8_gemv; built as they load)
    ple: bool = True  # qwen4_exp's PLE gate, value and dilated conv in one op, bf16 / fp32 (cpu_ple)
    block_gemv: bool = True  # GGUF blocks as the file holds them: Q2_K, Q3_K, IQ* and MoE experts (cpu_block_gemv)

    @classmethod
    def none(cls) -> "CpuKernels":
        """The torch ops everywhere: the reference."""
        return cls(**{f.name: False for f in fields(cls)})

    @classmethod
    def select(cls, config, device_type: str, dtype: torch.dtype) -> "CpuKernels":
        """From a KernelConfig (its --cpu-* switches) for a model running on device_type in dtype: what
        was asked for and can run here. Builds or loads the kernels that dtype uses now, once per
        machine (then cached), not in the first request."""
        if device_type != "cpu":
            return cls.none()
        from ember.kernels import (
            cpu_causal_attention,
            cpu_fused_elementwise,
            cpu_gated_delta_net,
            cpu_hc_mixer,
            cpu_ple,
            cpu_qsa_attention,
            cpu_qsa_scoring,
            cpu_row_top,
            cpu_tiled_gemv,
        )
        from ember.kernels.cpu_paged_attention import paged_attention_op

        cpu_row_top.available()  # the sampler's argmax, whatever the flags (~5 s once)
        return cls(
            paged_attention=config.paged_attention and paged_attention_op() is not None,
            # built only for the dtype that uses it; packed GGUF weights build the GEMV as they load
            flash_attention=config.flash_attention and cpu_causal_attention.flash_available(dtype),
            fused_elementwise=config.fused_elementwise
            and dtype in cpu_fused_elementwise.DTYPES
            and cpu_fused_elementwise.available(),
            tiled_gemv=config.tiled_gemv and cpu_tiled_gemv.x_dtype() is not None,
            int8_activations=config.int8_activations,
            # built as a GGUF file's 16-bit matrices load (GGUF float32 runs only)
            half_weights=config.half_weights,
            # hybrid models' (~10 s to build where it was not at install; a load of a few ms where it was)
            gated_delta_net=config.gated_delta_net and cpu_gated_delta_net.available(),
            # the sparse attention's kernel goes with the paged one (--cpu-paged-attention): ~15 s to build
            qsa_attention=config.paged_attention and cpu_qsa_attention.available(),
            qsa_scoring=config.paged_attention and cpu_qsa_scoring.available(),  # with it: ~10 s to build
            hc_mixer=config.fused_elementwise and dtype in cpu_hc_mixer.DTYPES and cpu_hc_mixer.available(),
            fp8_gemv=config.fp8_gemv,  # built as an FP8 checkpoint's weights load (ember.quant.fp8_linear)
            # qwen4_exp's PLE goes with the other fused elementwise kernels (--cpu-fused-elementwise)
            ple=config.fused_elementwise and dtype in cpu_ple.DTYPES and cpu_ple.available(),
            block_gemv=config.block_gemv,  # built as a GGUF file's block-kernel types load (ember.quant.gguf_block_part)
        )
