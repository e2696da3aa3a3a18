"""A random Qwen3.8-Flash-Next (qwen4_exp) of the release's proportions, scaled to 2 cores and 24 GiB, and its
GGUF files as users get them from llama.cpp's tools (`ember bench flash`).

What is kept from the release (../shared/research/qwen4exp.md section 1), and what is scaled:
- the layer pattern: three Gated DeltaNet layers to one QSA attention layer (8 layers: attention at 3 and 7;
  the release has 48), the GDN value heads three times the key heads, attention with 2 KV heads and a gate;
- many experts, top-10 routing and a shared expert: 128 experts (the release 512) of 384 (640), a shared one of
  384, so that a token reads 10 of 128 experts: 1/13 of a layer's experts (the release 1/51);
- 4 hyper-connection streams with a low-rank mixer (128; the release 320 at twice the width);
- PLE on layer 1 only (0-based; the config's 1-based [2]) with 16 hashed 2-/3-gram heads, whose table is
  sized so that it is over 2 GiB in every file, the bf16 one 7.8 GB: far over what a decode touches, so that
  "cold" is measurable;
- QSA with the real compress ratio 4 and an indexer of 4 heads; the budget scaled from 2,048 tokens to 512,
  so that 2,000-token prompts are sparse (a quarter of the blocks kept, as the release at 8K);
- Qwen's 151,936-id vocabulary (the converter takes only tokenizers it knows): with hidden 1024 the head is a
  larger share of a token's reads than the release's (~45% of the active weights against ~10%); the bench
  reports it as its own row of the per-op split.

Written once into a cache folder: the HF folder by transformers (Qwen4ExpForCausalLM, bf16, random
weights N(0, 0.02), drawn layer by layer in place), its bf16 GGUF by llama.cpp's converter, whose all-zero
attention.compress_ratios (transformers >= 5.23 writes the layer types as `indexed_attention`, which the
converter does not read) is set to what a correct conversion writes, and from it the quantized files by
llama.cpp's quantizer.
"""

from __future__ import annotations

import os

# the HF text config (transformers' Qwen4ExpTextConfig) of the bench's model
FLASH_SMALL = dict(
    vocab_size=151936,
    hidden_size=1024,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=4,
    linear_num_value_heads=12,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=128,
    num_experts_per_tok=10,
    moe_intermediate_size=384,
    shared_expert_intermediate_size=384,
    norm_topk_prob=True,
    hidden_act="silu",
    output_gate_type="sigmoid",
    rms_norm_eps=1e-6,
    hc_count=4,
    hc_lowrank=128,
    ple_layer_ids=[2],
    ple_embed_dim=1024,
    ple_conv_kernel_size=4,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=3_800_000,
    make_ngram_vocab_size_divisible_by=128,
    split_ngram_parts=4,
    seed=1234,
    indexer_n_heads=4,
    indexer_kv_heads=1,
    indexer_head_dim=64,
    indexer_budget=512,
    indexer_compress_ratio=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [6, 5, 5],
        "mrope_interleaved": True,
    },
    max_position_embeddings=32768,
    eos_token_id=151643,
    tie_word_embeddings=False,
)


def compress_ratios(shape: dict) -> list[int]:
    """What a correct conversion writes in attention.compress_ratios: the ratio on QSA layers (full_attention,
    or indexed_attention as transformers saves it), 0 on the Gated DeltaNet ones."""
    return [0 if t == "linear_attention" else shape["indexer_compress_ratio"] for t in shape["layer_types"]]


def build_folder(path: str, seed: int = 0, shape: dict = FLASH_SMALL) -> str:
    """The random HF folder (once). Built and drawn in bf16 in place (the table is 3.9G parameters: no float32
    copy of it is ever made); the (1 + w) norms at their identity."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    from ember.bench.peers.llamacpp_convert import write_qwen_tokenizer

    torch.manual_seed(seed)
    config = transformers.Qwen4ExpTextConfig(**shape, dtype="bfloat16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: transformers' init draws the table in place
    try:
        model = transformers.Qwen4ExpForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            _draw(name, p)
    partial = path + ".partial"
    model.save_pretrained(partial)
    write_qwen_tokenizer(partial)
    os.replace(partial, path)
    return path


def _draw(name: str, p) -> None:
    if name.endswith("A_log"):
        p.uniform_(-2.0, 1.5)
    elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
        p.fill_(1.0)
    elif "norm" in name:
        p.zero_()  # (1 + w) norms: 0 is the identity
    else:
        p.normal_(0.0, 0.02)


# --files kind -> a llama_ftype name after LLAMA_FTYPE_MOSTLY_, or a llamacpp_convert.MIXES recipe
FTYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "ud_q2_k_xl": "UD-Q2_K_XL"}
MIX_NOTE = (
    "the mix: llamacpp_convert.MIXES['UD-Q2_K_XL'], unsloth's UD-Q2_K_XL imitated one type per role (experts' gate "
    "and up IQ2_XXS, down IQ3_XXS, attention IQ3_XXS, its output and ssm_out IQ4_XS, shared experts Q4_K, head "
    "Q6_K; rows of a width llama.cpp cannot give those types fall back to its 32-element ones), with a uniform "
    "importance matrix"
)


def mtp_folder_of(model_folder: str) -> str:
    """Where build_mtp_folder writes the model's MTP layer: beside the folder."""
    return model_folder.rstrip("/") + ".mtp"


def build_mtp_folder(model_folder: str, seed: int = 1) -> str:
    """A random MTP layer for the folder's model (once), in the format `ember train-mtp` writes for qwen4_exp and
    `--speculative-config '{"method": "mtp", "model": FOLDER}'` reads (config.json naming the model's
    architecture, mtp.* safetensors): built by the model's own class (Qwen4ExpMTP) and drawn as build_folder
    draws the model (N(0, 0.02), the (1 + w) norms at their identity). llama.cpp's converter writes no MTP
    layer into the GGUF files, and the HF model has none: this is the layer a user would attach."""
    out = mtp_folder_of(model_folder)
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    import torch

    from ember.config.model_config import ModelConfig
    from ember.models.qwen4_exp import Qwen4ExpMTP
    from ember.train.mtp import write_mtp_folder

    cfg = ModelConfig.from_folder(model_folder)
    torch.manual_seed(seed)
    mtp = Qwen4ExpMTP(_ShapeOnlyModel(cfg, torch.bfloat16), 1)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            _draw(name, p)
    partial = out + ".partial"
    write_mtp_folder(mtp, cfg, partial)
    os.replace(partial, out)
    return out


class _ShapeOnlyModel:
    """What Qwen4ExpMTP reads of its model to build its layer (config, dtype, device, kernels, backend); the
    embedding, head and rotary table it borrows are the served model's, never touched by a writer."""

    def __init__(self, cfg, dtype):
        import torch

        from ember.kernels.cpu_kernels import CpuKernels

        self.cfg, self.dtype, self.device = cfg, dtype, torch.device("cpu")
        self.kernels, self.attn_backend, self.lm_head = CpuKernels(), None, None
        self.model = type("Body", (), {"embed_tokens": None, "rotary": None})()
