"""A tiny random qwen4_exp built by transformers (../shared/research/qwen4exp.md section 1's test config: the
release's ratios, 2 GDN + 2 QSA layers, PLE on the GDN layer after an attention layer, a QSA budget of 16
blocks so that 200-token prompts are sparse). Every parameter is perturbed: transformers initialises the
(1 + w) norm weights and the PLE conv to zero, which would leave those paths unexercised, and the n-gram rows get unit scale (its init's 0.02 left
PLE too faint for a wrong n-gram to move a greedy token)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch

VOCAB = 512
EOS = 1
CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "output_gate_type": "sigmoid",
    "rms_norm_eps": 1e-6,
    "hc_count": 4,
    "hc_lowrank": 16,
    "ple_layer_ids": [3],
    "ple_conv_kernel_size": 4,
    "ngram_size": 3,
    "heads_per_ngram": 2,
    "ngram_vocab_size_base": 1000,
    "make_ngram_vocab_size_divisible_by": 128,
    "split_ngram_parts": 2,
    "seed": 1234,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 64,
    "indexer_compress_ratio": 4,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
    "max_position_embeddings": 4096,
    "eos_token_id": EOS,
    "tie_word_embeddings": False,
}


def build_qwen4(seed: int = 0, **overrides):
    import transformers

    cfg = transformers.Qwen4ExpTextConfig(**(copy.deepcopy(CONFIG) | overrides))
    torch.manual_seed(seed)
    return _perturbed(transformers.Qwen4ExpForCausalLM(cfg).eval(), seed)


def build_qwen4_predictable(seed: int = 0, embed_scale: float = 50.0, head_scale: float = 30.0):
    """build_qwen4 whose greedy continuations an MTP layer can learn from a few hundred tokens (the MTP
    trainer's test). build_qwen4's own are not: its logits are nearly flat (std ~0.05, top-2 gap ~0.015: the
    teacher's distribution carries no signal) and its argmax is a hash of the context (unit-scale PLE
    n-gram rows, random layers; a bigram table from its greedy text predicts 0.18 of held-out tokens). Here
    the token embedding is scaled to unit std, so the residual follows the last token and the context moves
    it (a bigram table predicts about half), and the LM head so that its logits are peaked (std ~2.3) as a
    trained model's are. The same architecture and code paths; only two tensors rescaled."""
    model = build_qwen4(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(embed_scale)
        model.lm_head.weight.mul_(head_scale)
    return model


def build_qwen4_vl(seed: int = 0):
    """The released layout: Qwen4ExpForConditionalGeneration, the text model under model.language_model.*,
    a one-block vision tower beside it (served as text: the tower is skipped at load)."""
    import transformers

    vision = dict(
        depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=64, num_position_embeddings=64
    )
    cfg = transformers.Qwen4ExpConfig(text_config=copy.deepcopy(CONFIG), vision_config=vision)
    torch.manual_seed(seed)
    return _perturbed(transformers.Qwen4ExpForConditionalGeneration(cfg).eval(), seed)


def _perturbed(model, seed: int):
    """Every norm weight, bias and conv moved off its init; the n-gram rows at unit scale (the docstring)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 or "conv" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            if "ngram_embedding" in name:  # rows of unit scale: PLE moves the logits as much as a layer does
                p.copy_(torch.randn(p.shape, generator=g))
    return model


def save_qwen4(model, path: str) -> str:
    from tests.conftest import write_tiny_tokenizer

    model.save_pretrained(path)
    write_tiny_tokenizer(path, VOCAB)
    return path


# thinking always on, reasoning_effort low / medium / xhigh, Qwen3-Coder XML tool calls (the file's comment)
CHAT_TEMPLATE = Path(__file__).with_name("qwen4_chat_template.jinja")
# single tokens in Qwen's vocabulary (added, not special: decoding keeps them), so here too
CHAT_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")


def save_qwen4_chat(model, path: str) -> str:
    """save_qwen4, with the tokenizer a served Qwen3.8-Flash-Next has: CHAT_TOKENS as single tokens and
    CHAT_TEMPLATE as its chat template (the vocabulary stays VOCAB)."""
    import tokenizers

    from tests.conftest import write_tiny_tokenizer

    model.save_pretrained(path)
    write_tiny_tokenizer(path, VOCAB - len(CHAT_TOKENS))
    tok_file, config_file = os.path.join(path, "tokenizer.json"), os.path.join(path, "tokenizer_config.json")
    tok = tokenizers.Tokenizer.from_file(tok_file)
    tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in CHAT_TOKENS])
    assert tok.get_vocab_size() <= VOCAB
    tok.save(tok_file)
    with open(config_file) as f:
        config = json.load(f)
    with open(config_file, "w") as f:
        json.dump(config | {"chat_template": CHAT_TEMPLATE.read_text()}, f)
    return path


def prompt(length: int, seed: int, eos_at: tuple[int, ...] = ()) -> list[int]:
    """Ordinary ids (2..VOCAB-1), with EOS at the given indices (PLE restarts its n-grams after one)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (length,), generator=g).tolist()
    for i in eos_at:
        ids[i] = EOS
    return ids
