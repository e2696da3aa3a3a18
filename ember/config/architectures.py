"""Every model architecture ember serves, one row each: its HF name, its class, its GGUF name and
the traits the rest of the engine asks about. A new model is its file under ember/models/ plus
one row here.

The rows name their classes by "module:Class" (imported on use, ember.models.registry): this
table sits in config/ so that ModelConfig and the GGUF loader read it without importing the models.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.errors import UnsupportedModelError


@dataclass(frozen=True)
class Architecture:
    name: str
    """The `architectures` entry of a Hugging Face config.json."""
    model: str
    """Its implementation, "module:Class" under ember.models."""
    gguf: str | None = None
    """`general.architecture` of its GGUF files (None: ember reads it from safetensors only)."""
    gguf_model_type: str | None = None
    """The HF `model_type` a GGUF file's metadata becomes (ember.loader.gguf)."""
    hybrid: bool = False
    """Gated DeltaNet (linear-attention, recurrent-state) layers between full-attention ones."""
    vision_language: bool = False
    """A vision-language checkpoint: its config sits under `text_config`; served as its text model."""
    qk_norm: bool = False
    """A per-head RMSNorm on q and k before RoPE."""
    moe: bool = False
    """Its MLPs may be sparse (num_experts in config.json)."""
    all_layers_moe: bool = False
    """Every layer's MLP is sparse, whatever decoder_sparse_step and mlp_only_layers say."""
    norm_topk_prob: bool = False
    """The default of config.json's norm_topk_prob: renormalise the chosen experts' weights."""
    attention_bias: bool = False
    """The default of config.json's attention_bias."""
    qkv_bias_only: bool = False
    """attention_bias puts a bias on q, k and v but none on the output projection (Qwen2)."""
    hyper_connections: bool = False
    """Several residual streams mixed before every sublayer in place of its norm (qwen4_exp)."""


ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        Architecture("LlamaForCausalLM", "ember.models.llama:LlamaForCausalLM", gguf="llama", gguf_model_type="llama"),
        Architecture(
            "Qwen2ForCausalLM",
            "ember.models.llama:Qwen2ForCausalLM",
            gguf="qwen2",
            gguf_model_type="qwen2",
            attention_bias=True,
            qkv_bias_only=True,
        ),
        Architecture(
            "Qwen3ForCausalLM",
            "ember.models.llama:Qwen3ForCausalLM",
            gguf="qwen3",
            gguf_model_type="qwen3",
            qk_norm=True,
        ),
        Architecture(
            "Qwen3MoeForCausalLM",
            "ember.models.qwen3_moe:Qwen3MoeForCausalLM",
            gguf="qwen3moe",
            gguf_model_type="qwen3_moe",
            qk_norm=True,
            moe=True,
        ),
        Architecture(
            "Qwen3NextForCausalLM",
            "ember.models.qwen3_next:Qwen3NextForCausalLM",
            gguf="qwen3next",
            gguf_model_type="qwen3_next",
            hybrid=True,
            qk_norm=True,
            moe=True,
        ),
        Architecture(
            "Qwen3_5ForCausalLM",
            "ember.models.qwen3_next:Qwen3_5ForCausalLM",
            gguf="qwen35",
            gguf_model_type="qwen3_5_text",
            hybrid=True,
            qk_norm=True,
        ),
        Architecture(
            "Qwen3_5MoeForCausalLM",
            "ember.models.qwen3_next:Qwen3_5MoeForCausalLM",
            gguf="qwen35moe",
            gguf_model_type="qwen3_5_moe_text",
            hybrid=True,
            qk_norm=True,
            moe=True,
            all_layers_moe=True,
            norm_topk_prob=True,
        ),
        Architecture(
            "Qwen3_5ForConditionalGeneration",
            "ember.models.qwen3_next:Qwen3_5ForConditionalGeneration",
            hybrid=True,
            vision_language=True,
            qk_norm=True,
        ),
        Architecture(
            "Qwen3_5MoeForConditionalGeneration",
            "ember.models.qwen3_next:Qwen3_5MoeForConditionalGeneration",
            hybrid=True,
            vision_language=True,
            qk_norm=True,
            moe=True,
            all_layers_moe=True,
            norm_topk_prob=True,
        ),
        Architecture(
            "Qwen4ExpForCausalLM",
            "ember.models.qwen4_exp:Qwen4ExpForCausalLM",
            gguf="qwen4exp",
            gguf_model_type="qwen4_exp_text",
            hybrid=True,
            qk_norm=True,
            moe=True,
            all_layers_moe=True,
            norm_topk_prob=True,
            hyper_connections=True,
        ),
        Architecture(
            "Qwen4ExpForConditionalGeneration",
            "ember.models.qwen4_exp:Qwen4ExpForConditionalGeneration",
            hybrid=True,
            vision_language=True,
            qk_norm=True,
            moe=True,
            all_layers_moe=True,
            norm_topk_prob=True,
            hyper_connections=True,
        ),
    )
}

GGUF_ARCHITECTURES: dict[str, Architecture] = {a.gguf: a for a in ARCHITECTURES.values() if a.gguf is not None}
"""GGUF `general.architecture` -> its row."""


def architecture(name: str) -> Architecture:
    """The row of an HF architecture name; refuses one ember does not implement, saying which it does."""
    row = ARCHITECTURES.get(name)
    if row is None:
        raise UnsupportedModelError(
            f"model architecture {name!r} is not supported; ember supports {', '.join(ARCHITECTURES)}. "
            "Use a model of one of these architectures (see config.json 'architectures')"
        )
    return row
