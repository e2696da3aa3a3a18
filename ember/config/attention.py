"""--attention-backend -> the backend that runs on this device, or a ConfigError saying what to use.

  torch   the reference: SDPA over the gathered blocks, any device (ember.kernels.torch_attention)
  cpu     the reference with ember's C++ kernels where they apply and were built (fused paged
          attention for decodes and verifies, flash-style causal attention for bf16 prefill)
  triton  the GPU kernels; on CPU only under TRITON_INTERPRET=1 (how the tests run them)
  auto    triton on CUDA (when triton is installed), cpu on CPU, else torch
"""
from __future__ import annotations

import importlib.util
import os

from ember.config.groups import ATTENTION_BACKENDS
from ember.errors import ConfigError


def resolve_attention_backend(name: str, device=None) -> str:
    """name on `device` (a torch.device, a device type string, or None for CPU) -> torch | cpu | triton."""
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")
    device_type = getattr(device, "type", device) or "cpu"
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if device_type == "cuda":
            return "triton" if has_triton else "torch"
        return "cpu" if device_type == "cpu" else "torch"
    if name == "cpu" and device_type != "cpu":
        raise ConfigError(f"--attention-backend cpu runs ember's CPU kernels, not on {device_type}: use "
                          "--attention-backend triton (or auto) there")
    if name == "triton":
        if not has_triton:
            raise ConfigError("--attention-backend triton needs the triton package (pip install triton); "
                              "or use --attention-backend torch")
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ConfigError(f"--attention-backend triton runs on CUDA, not on {device_type}: use --attention-backend "
                              "cpu or --attention-backend torch (or auto), or set TRITON_INTERPRET=1 to run the kernels in Triton's "
                              "interpreter (slow; for tests)")
    return name
