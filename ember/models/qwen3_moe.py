"""Qwen3-MoE: the Qwen3 decoder (qk-norm, explicit head_dim) with a sparse MLP on MoE layers
(ModelConfig.is_moe_layer) and the dense SwiGLU elsewhere."""

from __future__ import annotations

from torch import nn

from ember.config.model_config import ModelConfig
from ember.errors import ModelLoadError
from ember.layers.moe import SparseMoeBlock
from ember.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        if cfg.num_experts <= 0 or cfg.num_experts_per_tok <= 0:
            raise ModelLoadError(
                "Qwen3MoeForCausalLM needs num_experts and num_experts_per_tok > 0 in config.json "
                f"(got {cfg.num_experts} and {cfg.num_experts_per_tok})"
            )
        super().__init__(cfg, *args, **kwargs)

    def make_mlp(self, cfg: ModelConfig, layer_idx: int, dtype, device) -> nn.Module:
        if cfg.is_moe_layer(layer_idx):
            return SparseMoeBlock(
                cfg.hidden_size,
                cfg.moe_intermediate_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                dtype,
                device,
                quant_config=self.quant_config,
                prefix=f"model.layers.{layer_idx}.mlp",
                kernels=self.kernels,
            )
        return super().make_mlp(cfg, layer_idx, dtype, device)
