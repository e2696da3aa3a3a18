"""Tiny random hybrid Qwen models (Qwen3-Next, Qwen3.5 dense / MoE, the Qwen3.5 VL layout), built
offline by transformers, with the odd shapes a real checkpoint may have: key heads != value heads,
dk != dv, head dims that are not powers of two, MoE top-k > 1, a full-attention layer that is not
the last, and a last layer that is linear."""

from __future__ import annotations

import torch

VOCAB = 320

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=48,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=20,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=12,
    linear_value_head_dim=10,
    linear_conv_kernel_dim=4,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
)

HYBRID_CONFIGS = {
    # MoE 6 experts top-2 + shared expert; layer 2 dense (mlp_only_layers); full attention every 3rd.
    "qwen3_next": dict(
        cls="Qwen3NextForCausalLM",
        cfg="Qwen3NextConfig",
        **_COMMON,
        num_hidden_layers=5,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention", "linear_attention"],
        intermediate_size=72,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[2],
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.4},
    ),
    # dense, tied embeddings, full_attention_interval 2 (layers 1 and 3), partial rotary outside rope_parameters.
    "qwen3_5": dict(
        cls="Qwen3_5ForCausalLM",
        cfg="Qwen3_5TextConfig",
        **_COMMON,
        num_hidden_layers=4,
        full_attention_interval=2,
        intermediate_size=80,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 2],
            "mrope_interleaved": True,
        },
    ),
    # MoE every layer, 5 experts top-3, default interval 4.
    "qwen3_5_moe": dict(
        cls="Qwen3_5MoeForCausalLM",
        cfg="Qwen3_5MoeTextConfig",
        **_COMMON,
        num_hidden_layers=4,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
        num_experts=5,
        num_experts_per_tok=3,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],
            "mrope_interleaved": True,
        },
    ),
}


HYBRID_ARCHS = [*HYBRID_CONFIGS, "qwen3_5_vl"]
# The published Qwen3.5 checkpoints: the text model of "qwen3_5" under model.language_model.*, and a
# (one-block) vision tower that ember skips.
_VISION = dict(
    depth=1,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=48,
    patch_size=4,
    num_position_embeddings=16,
)


def build_hybrid(arch: str, seed: int = 0, **overrides):
    """A random fp32 HF model whose every parameter is randomised: norms around their identity
    (zero-centred ones around 0), A_log and dt_bias spread so the decays differ per head.
    overrides: config keys to change (e.g. head counts that split over two ranks)."""
    import transformers

    spec = dict(HYBRID_CONFIGS["qwen3_5" if arch == "qwen3_5_vl" else arch]) | overrides
    cls, cfg_cls = getattr(transformers, spec.pop("cls")), getattr(transformers, spec.pop("cfg"))
    if arch == "qwen3_5_vl":
        tie = spec.pop("tie_word_embeddings")
        cls = transformers.Qwen3_5ForConditionalGeneration
        config = transformers.Qwen3_5Config(
            text_config=spec,
            vision_config=_VISION,
            tie_word_embeddings=tie,
            image_token_id=VOCAB - 20,
            video_token_id=VOCAB - 19,
            vision_start_token_id=VOCAB - 18,
            vision_end_token_id=VOCAB - 17,
        )
    else:
        config = cfg_cls(**spec)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(-2.0, 1.5))
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p))
            elif "embed" in name or "lm_head" in name:
                p.normal_(0.0, 0.5)
            elif "mlp.gate" in name and "proj" not in name:
                p.normal_(0.0, 0.5)  # routers: decisive routing, far from ties
            else:
                p.normal_(0.0, 0.15)
    return model


def save_hybrid(model, path: str) -> str:
    """The HF folder, with a tiny tokenizer (ember's loader wants one)."""
    from tests.conftest import write_tiny_tokenizer

    model.save_pretrained(path)
    write_tiny_tokenizer(path, VOCAB)
    return path


def add_mtp(hf_model, path: str, seed: int = 3) -> str:
    """Give the folder Qwen3-Next's native MTP layer (`mtp.*`, config mtp_num_hidden_layers: 1), random:
    mtp.fc, its two input norms, mtp.norm, and one full-attention decoder layer shaped like the model's
    own (gated attention; MoE with a shared expert where the model's layers are sparse). transformers
    skips these tensors; ember's MTP proposer drafts with them."""
    import json

    from safetensors.torch import load_file, save_file

    cfg = hf_model.config.get_text_config()
    attn_layer = cfg.layer_types.index("full_attention")
    g = torch.Generator().manual_seed(seed)
    text = hf_model.model.language_model if hasattr(hf_model.model, "language_model") else hf_model.model
    H = cfg.hidden_size
    mtp = {"mtp.fc.weight": torch.randn(H, 2 * H, generator=g) * 0.1}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.2 * torch.randn(H, generator=g)
    n_layers = cfg.num_hidden_layers
    sparse = [i for i in range(n_layers) if type(text.layers[i].mlp).__name__.endswith("SparseMoeBlock")]
    for name, p in text.layers[attn_layer].state_dict().items():
        if not name.startswith("mlp."):
            mtp[f"mtp.layers.0.{name}"] = p + 0.05 * torch.randn(p.shape, generator=g)
    mlp_src = text.layers[sparse[0] if sparse else attn_layer].mlp
    for name, p in mlp_src.state_dict().items():
        mtp[f"mtp.layers.0.mlp.{name}"] = p + 0.05 * torch.randn(p.shape, generator=g)
    tensors = load_file(f"{path}/model.safetensors")
    save_file(
        tensors | {k: v.contiguous() for k, v in mtp.items()}, f"{path}/model.safetensors", metadata={"format": "pt"}
    )
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    (config.get("text_config") or config)["mtp_num_hidden_layers"] = 1
    with open(f"{path}/config.json", "w") as f:
        json.dump(config, f)
    return path
