"""Resolve a model argument (HF folder, .gguf file, or nothing = the embedded default) into
a loaded model, its config and its tokenizer."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from ember.errors import ModelLoadError
from ember.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: object
    path: str
    format: str  # "gguf" | "safetensors"
    num_parameters: int
    weight_bytes: int  # bytes of the weights as held in memory
    load_seconds: float


def resolve_model_path(model: str | None) -> str:
    if model is None:
        from ember.default_model import default_model_path

        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model {model!r} not found: give a Hugging Face model folder or a .gguf file on this machine "
            "(ember never downloads weights), or omit it to use the embedded default model"
        )
    return path


def load_model(model: str | None, tokenizer_path: str | None, dtype: torch.dtype, device: torch.device,
               attention_backend: str) -> LoadedModel:
    from ember.kernels import get_attention_backend
    from ember.loader.tokenizer import Tokenizer
    from ember.models.registry import get_model_class

    t0 = time.perf_counter()
    path = resolve_model_path(model)
    if os.path.isfile(path):
        from ember.loader.gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
        model_config = ModelConfig.from_dict(ckpt.config)
        tokenizer = ckpt.tokenizer()
        from tqdm import tqdm

        # disable=None: a bar on a terminal, silence in logs and CI (as iter_safetensors does).
        weights = tqdm(ckpt.iter_weights(), total=None if model_config.num_experts else len(ckpt.tensor_names),
                       desc="Loading weights", unit="tensor", disable=None)
        fmt = "gguf"
    else:
        from ember.loader.weights import iter_safetensors

        model_config = ModelConfig.from_folder(path)
        tokenizer = None
        weights = iter_safetensors(path)
        fmt = "safetensors"
    if tokenizer_path is not None:
        tokenizer = Tokenizer.from_folder(tokenizer_path)
    elif tokenizer is None:
        tokenizer = Tokenizer.from_folder(path)

    model_cls = get_model_class(model_config.architecture)
    with torch.device(device):
        net = model_cls(model_config, dtype=dtype, device=device,
                        attn_backend=get_attention_backend(attention_backend))
    net.load_weights(weights)
    net.eval()
    params = {p.data_ptr(): p for p in net.parameters()}.values()  # tied weights counted once
    num_params = sum(p.numel() for p in params)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    return LoadedModel(net, model_config, tokenizer, path, fmt, num_params, weight_bytes, time.perf_counter() - t0)
