"""Weight quantization: which QuantMethod each Linear gets, decided once from the checkpoint.

`resolve_quant_config(requested, path, raw_config)` reads what the checkpoint holds (an AWQ or
block-wise FP8 `quantization_config`, a GGUF file, plain weights) and checks it against `--quantization`.
A mismatch is refused with what the checkpoint actually holds: "forgot --quantization awq,
then out of memory" cannot happen, because `auto` (the default) always follows the checkpoint
and an explicit value that contradicts it is an error.

A QuantConfig hands each layer its method by the layer's HF-style prefix
("model.layers.3.self_attn.qkv_proj"); None means dense.
"""

from __future__ import annotations

import json
import os

from ember.config.groups import QUANTIZATION_CHOICES
from ember.errors import ConfigError, UnsupportedModelError
from ember.kernels.cpu_kernels import CpuKernels
from ember.quant.quant_config import QuantConfig


def checkpoint_quantization(path: str, raw_config: dict | None) -> tuple[str, dict | None]:
    """(method the checkpoint holds: "awq" | "gguf" | "none" | other quant_method, its settings dict)."""
    if os.path.isfile(path):
        return "gguf", None
    qc = (raw_config or {}).get("quantization_config")
    if qc is None:
        legacy = os.path.join(path, "quant_config.json")  # older AutoAWQ exports
        if os.path.exists(legacy):
            with open(legacy) as f:
                qc = json.load(f)
            qc.setdefault("quant_method", "awq")
    if not qc:
        return "none", None
    return str(qc.get("quant_method", "unknown")).lower(), qc


def resolve_quant_config(
    requested: str | None, path: str, raw_config: dict | None, kernels: CpuKernels | None = None
) -> QuantConfig | None:
    """The QuantConfig to build the model with (None = dense), or a ConfigError on a mismatch."""
    config = _resolve(requested, path, raw_config)
    if config is not None and kernels is not None:
        config.kernels = kernels
    return config


def _resolve(requested: str | None, path: str, raw_config: dict | None) -> QuantConfig | None:
    requested = (requested or "auto").lower()
    if requested not in QUANTIZATION_CHOICES:
        raise ConfigError(f"--quantization {requested!r} is not one of {', '.join(QUANTIZATION_CHOICES)}")
    held, settings = checkpoint_quantization(path, raw_config)
    if held not in ("none", "awq", "gguf", "fp8"):
        raise UnsupportedModelError(
            f"{path} holds {held!r}-quantized weights (quantization_config.quant_method); ember loads awq and "
            "block-wise fp8 checkpoints and .gguf files. Use an AWQ export of the model, or quantize the "
            "full-precision weights with `ember quantize MODEL --method awq`"
        )
    if requested == "auto":
        requested = held
    what = {
        "none": "unquantized weights",
        "awq": "AWQ int4 weights (quantization_config.quant_method 'awq')",
        "gguf": "a GGUF file",
        "fp8": "block-wise FP8 weights (quantization_config.quant_method 'fp8')",
    }[held]
    if requested == "fp8" or held == "fp8":
        return _fp8(requested, held, path, what, settings)
    if requested == "none":
        if held == "awq":
            raise ConfigError(
                f"{path} holds {what}; they cannot run as dense weights. Pass --quantization awq (or leave it at auto)"
            )
        # A GGUF file with --quantization none is dequantized to the run dtype at load (more memory, fast GEMMs).
        return None
    if requested == "awq":
        if held != "awq":
            raise ConfigError(
                f"--quantization awq, but {path} holds {what}. Leave --quantization at auto, or "
                "make an AWQ checkpoint first with `ember quantize MODEL --method awq --out DIR`"
            )
        from ember.quant.awq import AWQConfig

        return AWQConfig.from_settings(settings)
    # requested == "gguf"
    if held != "gguf":
        raise ConfigError(
            f"--quantization gguf applies to .gguf files, but {path} holds {what}. Leave --quantization at auto"
        )
    from ember.quant.gguf_quant import GGUFConfig

    return GGUFConfig()


def _fp8(requested: str, held: str, path: str, what: str, settings: dict | None) -> QuantConfig:
    if held != "fp8":
        raise ConfigError(f"--quantization fp8 reads FP8 checkpoints, but {path} holds {what}. Leave it at auto")
    if requested != "fp8":
        raise ConfigError(
            f"{path} holds {what}; ember keeps them fp8 (dequantized per tile in its GEMVs). Pass "
            "--quantization fp8 (or leave it at auto), or use the bf16 checkpoint to run dense"
        )
    from ember.quant.fp8 import FP8Config

    return FP8Config.from_checkpoint(path, settings or {})


def process_weights_after_loading(model, after_each=None) -> None:
    """Let every quantized layer repack its loaded weights (e.g. into the CPU int4 kernel's layout);
    after_each(module), if given, runs after each layer's hook (ember.loader.shapes_only)."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        hook = getattr(method, "process_weights_after_loading", None)
        if hook is not None:
            hook(module)
            if after_each is not None:
                after_each(module)
