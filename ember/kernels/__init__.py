"""Kernels: the attention backends, the C++ CPU kernels and the Triton GPU kernels.

Which ones a model runs is decided once, when it is built, from objects passed in: the attention
backend (get_attention_backend) and CpuKernels (cpu_kernels.py). See attention_backend.py for the
backend contract.
"""

from __future__ import annotations

import torch

from ember.config.attention import resolve_attention_backend
from ember.config.groups import ATTENTION_BACKENDS
from ember.kernels.cpu_kernels import CpuKernels

__all__ = ["ATTENTION_BACKENDS", "CpuKernels", "get_attention_backend", "resolve_attention_backend"]


def get_attention_backend(name: str, device: torch.device | str | None = None, kernels: CpuKernels | None = None):
    """The backend object for --attention-backend `name` on `device` (None: CPU); `kernels` says
    which C++ kernels the cpu backend may use (default: all that are built)."""
    name = resolve_attention_backend(name, device)
    if name == "triton":
        from ember.kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "cpu":
        from ember.kernels.cpu_attention import CpuAttentionBackend

        kernels = kernels or CpuKernels()
        return CpuAttentionBackend(fused_decode=kernels.paged_attention, flash=kernels.flash_attention)
    from ember.kernels.torch_attention import TorchAttentionBackend

    return TorchAttentionBackend()
