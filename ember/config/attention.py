"""--attention-backend -> the backend that runs on this device, or a ConfigError saying what to use.

  torch   the reference: SDPA over the gathered blocks, any device (ember.kernels.torch_attention)
  cpu     the reference with ember's C++ kernels where they apply and were built (fused paged
          attention for decodes and verifies, flash-style causal attention for bf16 prefill)
  triton  the GPU kernels; on CPU only under TRITON_INTERPRET=1 (how the tests run them)
  auto    triton on CUDA (when triton is installed), cpu on CPU, else torch
Other engines' names are accepted with a note (ATTENTION_BACKEND_ALIASES): flash2 (an older guide's
name for a split-KV decode kernel), flashinfer, fa3 and flash_attn mean triton on CUDA and cpu on CPU;
torch_native (SGLang) means torch.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os

from ember.config.aliases import ATTENTION_BACKEND_ALIASES
from ember.config.groups import ATTENTION_BACKENDS
from ember.errors import ConfigError

logger = logging.getLogger("ember")


def resolve_attention_backend(name: str, device=None) -> str:
    """name on `device` (a torch.device, a device type string, or None for CPU) -> torch | cpu | triton.
    Other engines' names (ATTENTION_BACKEND_ALIASES: flash2, flashinfer, fa3, ...) map to ember's, with
    a one-line note of what runs."""
    device_type = getattr(device, "type", device) or "cpu"
    if name in ATTENTION_BACKEND_ALIASES:
        target = ATTENTION_BACKEND_ALIASES[name]
        if target == "gpu":
            target = "triton" if device_type == "cuda" else "cpu" if device_type == "cpu" else "torch"
        _note_alias(name, target, device_type)
        name = target
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of: {', '.join(ATTENTION_BACKENDS)}")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if device_type == "cuda":
            return "triton" if has_triton else "torch"
        return "cpu" if device_type == "cpu" else "torch"
    if name == "cpu" and device_type != "cpu":
        raise ConfigError(
            f"--attention-backend cpu runs ember's CPU kernels, not on {device_type}: use "
            "--attention-backend triton (or auto) there"
        )
    if name == "triton":
        if not has_triton:
            raise ConfigError(
                "--attention-backend triton needs the triton package (pip install triton); "
                "or use --attention-backend torch"
            )
        if device_type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ConfigError(
                f"--attention-backend triton runs on CUDA, not on {device_type}: use --attention-backend "
                "cpu or --attention-backend torch (or auto), or set TRITON_INTERPRET=1 to run the kernels in Triton's "
                "interpreter (slow; for tests)"
            )
    return name


@functools.cache
def _note_alias(name: str, target: str, device_type: str) -> None:
    what = {
        "triton": "ember's Triton kernels (split-KV decode, varlen prefill)",
        "cpu": "the torch reference with ember's C++ kernels (fused paged decode, flash-style prefill)",
        "torch": "the torch reference (SDPA)",
    }[target]
    logger.info(
        "ember: --attention-backend %s is another engine's name; on %s ember runs --attention-backend %s: %s",
        name,
        device_type,
        target,
        what,
    )
