"""An AutoAWQ-compatible int4 folder from full-precision weights (`ember quantize`, whose flags are in
ember.entrypoints.quantize).

The source (an HF folder or a .gguf file, dequantized) is loaded dense in float32 on the CPU.
`awq` runs the activation-aware scale and clipping search (ember.train.awq_search) on
calibration text first; `rtn` packs the weights by plain round-to-nearest, the baseline.
Two defaults of `awq` go beyond AutoAWQ and keep its checkpoint format (integer zero points,
same packing): `--clip asym` searches each group's lower and upper clip separately and snaps
the integer zero point (`--clip sym` is AutoAWQ's symmetric search), and `--gptq` chooses the
codes on each group's grid by GPTQ's error-compensating rounding (`--no-gptq`: round to nearest).

The search costs about 20 forwards of each Linear group per layer over all calibration tokens,
so its time grows with --num-samples x --seq-len: SmolLM2-135M (30 layers) with 16 x 512 tokens
took 17 min on 2 busy CPU cores, 11 min on 1 busy core with --clip asym --gptq (AutoAWQ's 128 x 512
would be ~8x that); rtn takes seconds.
"""

from __future__ import annotations

import logging
import os
import time

import torch

from ember.errors import ConfigError

log = logging.getLogger(__name__)

METHODS = ("awq", "rtn")
# Default model, g32, 16 x 512 pydoc calib, held-out pydoc perplexity (dense bf16 14.925):
# --clip sym --no-gptq (AutoAWQ) 16.210, asym --no-gptq 16.196, sym --gptq 15.850, asym --gptq 15.815.
GPTQ_DEFAULT = True


def _source_config(path: str):
    """The source's ModelConfig, read without loading weights; refuses an already-quantized folder."""
    from ember.config.model_config import ModelConfig
    from ember.quant import checkpoint_quantization

    if os.path.isfile(path):
        from ember.loader.gguf import GGUFCheckpoint

        return ModelConfig.from_dict(GGUFCheckpoint(path).config)
    cfg = ModelConfig.from_folder(path)
    held, _ = checkpoint_quantization(path, cfg.raw)
    if held != "none":
        raise ConfigError(f"{path} already holds {held!r}-quantized weights; quantize the full-precision model")
    return cfg


def quantize(
    model: str | None,
    out: str,
    method: str = "awq",
    bits: int = 4,
    group_size: int = 128,
    zero_point: bool = True,
    calib: str = "pydoc",
    num_samples: int = 128,
    seq_len: int = 512,
    progress: bool | None = None,
    clip: str = "asym",
    gptq: bool = GPTQ_DEFAULT,
) -> str:
    """Quantize `model` (None = the embedded default) into the folder `out`; returns `out`."""
    from ember.loader.model_loader import load_model, resolve_model_path
    from ember.train.awq_export import write_awq_folder
    from ember.train.awq_search import CLIP_MODES, awq_search, check_quant_settings
    from ember.train.calibration import calibration_blocks, calibration_texts

    if method not in METHODS:
        raise ConfigError(f"--method {method!r} is not one of {', '.join(METHODS)}")
    if clip not in CLIP_MODES:
        raise ConfigError(f"--clip {clip!r} is not one of {', '.join(CLIP_MODES)}")
    path = resolve_model_path(model)
    check_quant_settings(_source_config(path), bits, group_size, zero_point)
    if os.path.abspath(out) == os.path.abspath(path):
        raise ConfigError("--out is the source model's folder; write the quantized model to a new folder")
    if os.path.isdir(out) and os.listdir(out):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new folder or empty it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"--out {out} is a file; give a folder")
    texts = calibration_texts(calib) if method == "awq" else None  # a bad --calib fails before the load
    t0 = time.perf_counter()
    loaded = load_model(path, None, torch.float32, torch.device("cpu"), "torch", "none")
    if method == "awq":
        ids = calibration_blocks(loaded.tokenizer, texts, num_samples, seq_len)
        log.info(
            "AWQ: %d calibration blocks of %d tokens from %s, group size %d, %s clipping, %s rounding",
            ids.shape[0],
            ids.shape[1],
            calib,
            group_size,
            clip,
            "GPTQ" if gptq else "nearest",
        )
        awq_search(loaded.model, ids, group_size, progress=progress, clip=clip, gptq=gptq)
    write_awq_folder(loaded, out, group_size)
    log.info("wrote %s (%s, int4, group %d) in %.1f s", out, method, group_size, time.perf_counter() - t0)
    return out
