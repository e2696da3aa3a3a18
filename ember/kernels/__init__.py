"""Attention backends: `torch` (CPU reference, ground truth) and `triton` (GPU kernels; on CPU only
under TRITON_INTERPRET=1, which is how the tests check them), with the same forward signature.
`auto` picks triton on CUDA (when triton is installed) and torch elsewhere."""
from __future__ import annotations

import importlib.util
import os

import torch

from ember.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def resolve_attention_backend(name: str, device: torch.device | str | None = None) -> str:
    """auto -> triton on CUDA with triton installed, else torch; checks that triton can run there."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")
    device_type = torch.device(device).type if device is not None else "cpu"
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device_type == "cuda" and has_triton else "torch"
    if name == "triton":
        if not has_triton:
            raise ConfigError("--attention-backend triton needs the triton package (pip install triton); "
                              "or use --attention-backend torch")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ConfigError(f"--attention-backend triton runs on CUDA, not on {device_type}: use --attention-backend "
                              "torch (or auto), or set TRITON_INTERPRET=1 to run the kernels in Triton's "
                              "interpreter (slow; for tests)")
    return name


def get_attention_backend(name: str, device: torch.device | str | None = None):
    """The backend object for --attention-backend `name` on `device` (None: CPU)."""
    name = resolve_attention_backend(name, device)
    if name == "triton":
        from ember.kernels.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    from ember.kernels.torch_attention import TorchAttentionBackend

    return TorchAttentionBackend()
