"""Attention backends: `torch` (CPU reference, ground truth); GPU kernels join with the same signature."""
from __future__ import annotations

from ember.errors import ConfigError

ATTENTION_BACKENDS = ("torch",)


def get_attention_backend(name: str):
    if name == "torch":
        from ember.kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    raise ConfigError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")
