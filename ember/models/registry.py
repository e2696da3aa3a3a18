"""HF "architectures" name -> model class. A new model is one file plus one line here."""
from __future__ import annotations

import importlib

from ember.errors import UnsupportedModelError

_MODELS = {
    "LlamaForCausalLM": ("ember.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("ember.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("ember.models.llama", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("ember.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("ember.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("ember.models.qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("ember.models.qwen3_next", "Qwen3_5MoeForCausalLM"),
    # vision-language checkpoints, served as their text model (the vision tower is skipped)
    "Qwen3_5ForConditionalGeneration": ("ember.models.qwen3_next", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("ember.models.qwen3_next", "Qwen3_5MoeForConditionalGeneration"),
}


def get_model_class(architecture: str) -> type:
    if architecture not in _MODELS:
        raise UnsupportedModelError(
            f"model architecture {architecture!r} is not supported; ember supports {', '.join(_MODELS)}. "
            "Use a model of one of these architectures (see config.json 'architectures')"
        )
    module, cls = _MODELS[architecture]
    return getattr(importlib.import_module(module), cls)
