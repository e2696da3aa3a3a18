"""ModelConfig: the architecture facts the engine needs, read from a HF config.json dict.

A GGUF file's metadata is turned into the same dict shape by ember.loader.gguf, so every
format goes through one parser.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ember.config.architectures import ARCHITECTURES, Architecture
from ember.errors import ModelLoadError

FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"
# qwen4_exp's attention layers (QSA: full attention over the blocks an indexer selects), as spelled in the
# release (full_attention), by transformers >= 5.23 (indexed_attention) and by some exports
INDEXED_ATTENTION_SPELLINGS = ("indexed_attention", "qwen_sparse_attention")


@dataclass(frozen=True)
class PLEConfig:
    """qwen4_exp's per-layer n-gram embedding (ember.layers.ple): hashed 2..ngram_size-gram rows of a large
    table, gated per hyper-connection stream, then a dilated depthwise conv (its dilation is ngram_size)."""

    layers: tuple[int, ...]  # 0-based (config.json's ple_layer_ids are 1-based)
    embed_dim: int
    conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    vocab_size_base: int
    vocab_divisible_by: int
    seed: int
    eos_token_id: int  # the n-gram context restarts after it (the first of a list, as transformers reads it)

    @property
    def num_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def conv_window(self) -> int:
        """Columns of the conv's input a sequence carries between steps: (K - 1) x dilation."""
        return (self.conv_kernel - 1) * self.ngram_size


@dataclass(frozen=True)
class IndexerConfig:
    """qwen4_exp's QSA indexer (ember.layers.qsa): scores mean-pooled blocks of compress_ratio keys and keeps
    the top budget / compress_ratio blocks plus the incomplete tail; dense below budget + ratio tokens."""

    num_heads: int
    head_dim: int
    budget: int
    compress_ratio: int

    @property
    def dense_below(self) -> int:
        """Visible tokens up to which the selection keeps every token (budget + ratio - 1)."""
        return self.budget + self.compress_ratio - 1


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
    # Hybrid (Qwen3-Next / Qwen3.5): per layer "full_attention" or "linear_attention" (Gated
    # DeltaNet); the linear layers' head counts and dims; the MoE's shared expert.
    layer_types: list[str] = field(default_factory=list)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    shared_expert_intermediate_size: int = 0
    # qwen4_exp: hyper-connections (hc_count residual streams, ember.layers.hyper_connection), the GDN
    # output gate's activation, the per-layer n-gram embedding and the QSA indexer
    hc_count: int = 0
    hc_lowrank: int = 0
    output_gate_type: str = "silu"
    ple: PLEConfig | None = None
    indexer: IndexerConfig | None = None
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def traits(self) -> Architecture:
        """This architecture's row of the table (ember.config.architectures)."""
        return ARCHITECTURES[self.architecture]

    @property
    def is_hybrid(self) -> bool:
        return self.traits.hybrid

    @property
    def attention_layers(self) -> list[int]:
        """The layers with a paged KV cache (every layer but a hybrid's linear-attention ones)."""
        return [i for i in range(self.num_layers) if self.layer_type(i) == FULL_ATTENTION]

    @property
    def num_kv_layers(self) -> int:
        return len(self.attention_layers)

    def layer_type(self, layer_idx: int) -> str:
        return self.layer_types[layer_idx] if self.layer_types else FULL_ATTENTION

    @property
    def linear_conv_dim(self) -> int:
        """Channels of a Gated DeltaNet layer's causal conv: q, k and v."""
        return (
            2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
        )

    def state_bytes_per_seq(self, conv_elem_bytes: int, tp: int = 1) -> int:
        """One sequence's recurrent state over every linear-attention layer, on one device: the conv
        window (K - 1 inputs, model dtype) and the fp32 SSM state [value heads, dk, dv]."""
        n = self.num_layers - self.num_kv_layers
        conv = self.linear_conv_dim // tp * (self.linear_conv_kernel_dim - 1) * conv_elem_bytes
        ssm = self.linear_num_value_heads // tp * self.linear_key_head_dim * self.linear_value_head_dim * 4
        ple = 0
        if self.ple is not None:  # its conv window over the streams and the last ngram_size - 1 ids (int64)
            width = self.hc_count * self.hidden_size
            ple = len(self.ple.layers) * (
                self.ple.conv_window * width * conv_elem_bytes + (self.ple.ngram_size - 1) * 8
            )
        return n * (conv + ssm) + ple

    def is_moe_layer(self, layer_idx: int) -> bool:
        if self.traits.all_layers_moe:
            return True
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )

    @property
    def kv_bytes_per_token_per_dtype_byte(self) -> int:
        """K and V elements one token stores over all attention layers (multiply by the element size)."""
        return 2 * self.num_kv_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; ember supports "
                f"{', '.join(ARCHITECTURES)}"
            )
        traits = ARCHITECTURES[arch]
        if traits.vision_language:
            cfg = text_config(cfg)
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
                attention_bias=bool(cfg.get("attention_bias", traits.attention_bias)),
                qk_norm=traits.qk_norm,
                num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0) if traits.moe else 0,
                num_experts_per_tok=int(cfg.get("num_experts_per_tok", 0) or 0),
                moe_intermediate_size=int(cfg.get("moe_intermediate_size", 0) or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", traits.norm_topk_prob)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1) or 1),
                mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
                **_hybrid_fields(arch, cfg),
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


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A vision-language checkpoint's text model config, as a plain CausalLM config dict (the
    top-level tie_word_embeddings and architectures win: they describe the checkpoint)."""
    text = dict(cfg.get("text_config") or {})
    if not text:
        raise ModelLoadError(f"{cfg['architectures'][0]} config has no text_config")
    text["architectures"] = cfg["architectures"]
    for key in ("tie_word_embeddings", "torch_dtype", "dtype", "quantization_config"):
        if key in cfg and key not in text:
            text[key] = cfg[key]
    if "tie_word_embeddings" in cfg:
        text["tie_word_embeddings"] = cfg["tie_word_embeddings"]
    return text


def _hybrid_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next / Qwen3.5 keys; refuses the variants ember does not implement, by name."""
    if not ARCHITECTURES[arch].hybrid:
        return {}
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION for i in range(n)]
    types = list(types)
    if ARCHITECTURES[arch].hyper_connections:
        types = [FULL_ATTENTION if t in INDEXED_ATTENTION_SPELLINGS else t for t in types]
    bad = sorted(set(types) - {FULL_ATTENTION, LINEAR_ATTENTION})
    if len(types) != n or bad:
        raise ModelLoadError(
            f"{arch}: layer_types must list {n} entries of {FULL_ATTENTION!r} / {LINEAR_ATTENTION!r} "
            f"(got {len(types)}{', unknown ' + str(bad) if bad else ''})"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{arch}: hidden_act {act!r} is not supported (ember implements silu)")
    if cfg.get("attn_output_gate", True) is False:
        raise ModelLoadError(f"{arch}: attn_output_gate=false is not supported (ember implements the gated attention)")
    ssm_dtype = cfg.get("mamba_ssm_dtype", "float32")
    if ssm_dtype not in ("float32", None):
        raise ModelLoadError(
            f"{arch}: mamba_ssm_dtype {ssm_dtype!r} is not supported; ember keeps the recurrent state in float32"
        )
    f = dict(
        layer_types=types,
        linear_num_key_heads=int(cfg.get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(cfg.get("linear_num_value_heads", 32)),
        linear_key_head_dim=int(cfg.get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(cfg.get("linear_value_head_dim", 128)),
        linear_conv_kernel_dim=int(cfg.get("linear_conv_kernel_dim", 4)),
        shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size", 0) or 0),
    )
    if f["linear_num_value_heads"] % f["linear_num_key_heads"]:
        raise ModelLoadError(
            f"{arch}: linear_num_value_heads {f['linear_num_value_heads']} must be a multiple of "
            f"linear_num_key_heads {f['linear_num_key_heads']}"
        )
    if f["linear_conv_kernel_dim"] < 2:
        raise ModelLoadError(f"{arch}: linear_conv_kernel_dim must be at least 2")
    if ARCHITECTURES[arch].hyper_connections:
        f.update(_qwen4_fields(arch, cfg, types))
    return f


def _qwen4_fields(arch: str, cfg: dict[str, Any], types: list[str]) -> dict[str, Any]:
    """qwen4_exp's keys, checked against the invariants its layers rely on (transformers'
    validate_architecture), each refusal naming the key."""
    hidden, n = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    hc, lowrank = int(cfg.get("hc_count", 4)), int(cfg.get("hc_lowrank", 0) or 0)
    if hc < 2 or lowrank < 1:
        raise ModelLoadError(f"{arch}: hc_count must be at least 2 and hc_lowrank at least 1 (got {hc}, {lowrank})")
    gate = cfg.get("output_gate_type") or cfg.get("hidden_act", "silu")
    if gate not in ("sigmoid", "silu"):
        raise ModelLoadError(f"{arch}: output_gate_type {gate!r} is not one of sigmoid, silu")
    eos = cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    ple = None
    ids = [int(i) for i in cfg.get("ple_layer_ids") or []]
    if ids:
        if eos is None:
            raise ModelLoadError(f"{arch}: PLE restarts its n-grams after eos_token_id, which the config lacks")
        bad = [i for i in ids if not 1 <= i <= n or types[i - 1] != LINEAR_ATTENTION]
        if bad:
            raise ModelLoadError(f"{arch}: ple_layer_ids {bad} (1-based) must name linear-attention layers of the {n}")
        ple = PLEConfig(
            layers=tuple(i - 1 for i in ids),
            embed_dim=int(cfg.get("ple_embed_dim") or hidden),
            conv_kernel=int(cfg.get("ple_conv_kernel_size", 4)),
            ngram_size=int(cfg.get("ngram_size", 3)),
            heads_per_ngram=int(cfg.get("heads_per_ngram", 8)),
            vocab_size_base=int(cfg.get("ngram_vocab_size_base", 20_000_000)),
            vocab_divisible_by=int(cfg.get("make_ngram_vocab_size_divisible_by", 128)),
            seed=int(cfg.get("seed", 1234)),
            eos_token_id=int(eos),
        )
        if ple.ngram_size < 2 or ple.embed_dim % ple.num_heads:
            raise ModelLoadError(
                f"{arch}: ple_embed_dim {ple.embed_dim} must divide into (ngram_size - 1) x heads_per_ngram "
                f"= {ple.num_heads} heads, and ngram_size must be at least 2"
            )
    keys = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    indexer = None
    if any(cfg.get(k) for k in keys):
        missing = [k for k in keys if not cfg.get(k)]
        if missing:
            raise ModelLoadError(f"{arch}: the QSA indexer needs {', '.join(missing)} in the config")
        indexer = IndexerConfig(*(int(cfg[k]) for k in keys))
        if int(cfg.get("indexer_kv_heads", 1)) != 1 or indexer.budget % indexer.compress_ratio:
            raise ModelLoadError(
                f"{arch}: the QSA indexer needs indexer_kv_heads 1 and indexer_budget a multiple of "
                f"indexer_compress_ratio (got {cfg.get('indexer_kv_heads')}, {indexer.budget}, {indexer.compress_ratio})"
            )
    return dict(hc_count=hc, hc_lowrank=lowrank, output_gate_type=gate, ple=ple, indexer=indexer)


def _parse_rope(cfg: dict[str, Any]) -> RopeConfig:
    # transformers <= 4: rope_theta + rope_scaling; transformers >= 5: rope_parameters.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope = RopeConfig(theta=float(theta), type=rope_type)
    # Qwen3-Next / Qwen3.5 rotate a quarter of head_dim when the config does not say (transformers' default)
    hybrid = any(a in ARCHITECTURES and ARCHITECTURES[a].hybrid for a in cfg.get("architectures") or [])
    rope.partial_rotary_factor = float(
        params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25 if hybrid else 1.0))
    )
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
