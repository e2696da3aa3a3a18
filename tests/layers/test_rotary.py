"""RoPE: inv_freq / attention factor equal transformers' rope init functions; rotation equals HF's."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ember.config.model_config import ModelConfig
from ember.layers.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq

BASE = dict(
    architectures=["Qwen3ForCausalLM"],
    vocab_size=100,
    hidden_size=64,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)

CASES = {
    "linear": dict(
        head_dim=64,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    ),
    "llama3": dict(
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "yarn-qwen": dict(
        head_dim=128,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 1000000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32768,
        },
    ),
    "yarn-mscale": dict(
        head_dim=64,
        max_position_embeddings=16384,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 16,
            "beta_slow": 2,
            "original_max_position_embeddings": 4096,
        },
    ),
    "yarn-partial": dict(
        head_dim=64,
        max_position_embeddings=8192,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 2.0,
            "partial_rotary_factor": 0.5,
            "original_max_position_embeddings": 4096,
        },
    ),
    # transformers <= 4 spelling: rope_theta + rope_scaling {"type": ...}
    "yarn-legacy": dict(
        head_dim=64,
        max_position_embeddings=8192,
        rope_theta=1000000.0,
        rope_scaling={"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096},
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_inv_freq_matches_hf(case):
    cfg_dict = {**BASE, **CASES[case]}
    hf_cfg = Qwen3Config(**{k: v for k, v in cfg_dict.items() if k != "architectures"})
    rope_type = hf_cfg.rope_parameters["rope_type"]
    hf_inv, hf_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_cfg, "cpu")
    cfg = ModelConfig.from_dict(cfg_dict)
    inv, factor = compute_inv_freq(cfg.rope, cfg.head_dim, cfg.max_position_embeddings)
    assert inv.dtype == torch.float32
    assert torch.equal(inv, hf_inv.float())
    assert factor == pytest.approx(hf_factor, rel=1e-12)


def test_yarn_qwen_numbers():
    """formats.md 7: hd 128, theta 1e6, s 4, L0 32768 -> attention_factor 1.138629, ramp 23..40."""
    cfg = ModelConfig.from_dict({**BASE, **CASES["yarn-qwen"]})
    inv, factor = compute_inv_freq(cfg.rope, 128, cfg.max_position_embeddings)
    assert factor == pytest.approx(0.1 * math.log(4) + 1)
    assert round(factor, 6) == 1.138629
    ext = 1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128))
    assert torch.equal(inv[:23], ext[:23])  # high-frequency dims kept
    assert torch.allclose(inv[40:], ext[40:] / 4)  # low-frequency dims interpolated


def test_default_inv_freq_matches_hf_default():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg_dict = {**BASE, "head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    hf_inv, _ = Qwen3RotaryEmbedding.compute_default_rope_parameters(Qwen3Config(**cfg_dict))
    cfg = ModelConfig.from_dict(cfg_dict)
    inv, factor = compute_inv_freq(cfg.rope, 32, 4096)
    assert torch.equal(inv, hf_inv) and factor == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_matches_hf(dtype):
    cfg = ModelConfig.from_dict({**BASE, **CASES["yarn-qwen"]})
    rope = RotaryEmbedding(128, cfg.rope, 64)
    positions = torch.tensor([0, 5, 63, 64, 200])  # past max_position_embeddings: the cache grows
    q = torch.randn(5, 4, 128).to(dtype)
    k = torch.randn(5, 2, 128).to(dtype)
    qo, ko = rope(positions, q, k)
    assert qo.dtype == dtype and rope.cos_cache.shape[0] >= 201
    # HF: cos/sin from fp32 freqs * attention factor, rotation in float32 here.
    freqs = positions[:, None].float() * rope.inv_freq
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos() * rope.attention_factor, emb.sin() * rope.attention_factor
    hq, hk = apply_rotary_pos_emb(q.float(), k.float(), cos, sin, unsqueeze_dim=1)
    assert torch.equal(qo, hq.to(dtype)) and torch.equal(ko, hk.to(dtype))


def test_partial_rotary_passes_tail_through():
    cfg = ModelConfig.from_dict({**BASE, **CASES["yarn-partial"]})
    rope = RotaryEmbedding(64, cfg.rope, cfg.max_position_embeddings)
    x = torch.randn(3, 2, 64)
    cos, sin = rope.get_cos_sin(torch.tensor([1, 2, 3]))
    assert cos.shape == (3, 16)
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 32:], x[..., 32:])
    assert not torch.equal(out[..., :32], x[..., :32])
