"""ModelConfig: the architecture facts the engine needs, read from a HF config.json dict.

A GGUF file's metadata is turned into the same dict shape by ember.loader.gguf, so every
format goes through one parser.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ember.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
)


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # default | linear | llama3 | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial_rotary_factor: float = 1.0


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: q/k/v have a bias
    qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE
    # Qwen3-MoE
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def kv_bytes_per_token_per_dtype_byte(self) -> int:
        """K and V elements one token stores over all layers (multiply by the element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; ember supports "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            head_dim = cfg.get("head_dim") or hidden // heads
            return cls(
                architecture=arch,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg.get("intermediate_size", 0)),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
                rope=_parse_rope(cfg),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
                qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if arch == "Qwen3MoeForCausalLM" else 0,
                num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
                torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=cfg.get("eos_token_id"),
                raw=cfg,
            )
        except KeyError as e:
            raise ModelLoadError(f"config is missing the key {e.args[0]!r}") from None

    @classmethod
    def from_folder(cls, path: str) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ModelLoadError(f"{path} has no config.json; give a Hugging Face model folder or a .gguf file")
        try:
            with open(cfg_path) as f:
                cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_path} is not valid JSON: {e}") from None
        return cls.from_dict(cfg)


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers <= 4: rope_theta + rope_scaling; transformers >= 5: rope_parameters.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope = RopeConfig(theta=float(theta), type=rope_type)
    rope.partial_rotary_factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if rope_type == "default":
        return rope
    if rope_type not in ("linear", "llama3", "yarn"):
        raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}; ember supports linear, llama3 and yarn")
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    orig = params.get("original_max_position_embeddings")
    rope.original_max_position_embeddings = int(orig) if orig else max_pos
    factor = params.get("factor")
    rope.factor = float(factor) if factor else max_pos / rope.original_max_position_embeddings
    rope.low_freq_factor = float(params.get("low_freq_factor", 1.0))
    rope.high_freq_factor = float(params.get("high_freq_factor", 4.0))
    rope.beta_fast = float(params.get("beta_fast") or 32.0)
    rope.beta_slow = float(params.get("beta_slow") or 1.0)
    af = params.get("attention_factor")
    rope.attention_factor = float(af) if af is not None else None
    rope.mscale = params.get("mscale")
    rope.mscale_all_dim = params.get("mscale_all_dim")
    rope.truncate = bool(params.get("truncate", True))
    return rope
