"""`ember bench hybrid`: the hybrid rows -- a random-weight model of Qwen3.5-0.8B's shape run by ember,
by llama.cpp and by transformers on the same weights, same threads, in one `bench compare` run.

The model is written once into a cache folder: an HF folder by transformers (Qwen3_5ForCausalLM,
bf16, random weights), then a GGUF of it by llama.cpp's own converter (ember.bench.peers.llamacpp_convert)
for the llama.cpp side; ember and transformers read the HF folder (the GGUF holds the same bf16
values). The tokenizer is Qwen's (151,936 ids, from llama.cpp's own vocab file: the converter only
takes tokenizers it knows); the config's vocab_size stays Qwen3.5's 248,320 (the converter pads the
GGUF vocabulary), so the embedding and the tied head have Qwen3.5-0.8B's size. Prompts are token ids, so the text
the random model writes does not matter. No speed bar is judged here (hybrid kernels come later).
"""

from __future__ import annotations

import logging
import os

from ember.bench.commands import compare

logger = logging.getLogger("ember.bench")

NAME = "hybrid"
HELP = (
    "a random-weight Qwen3.5-0.8B-shaped hybrid (Gated DeltaNet) model: ember vs llama.cpp vs transformers on the "
    "same weights (built once into a cache folder; the GGUF by llama.cpp's converter)"
)
PARSER = compare.PARSER

# Qwen3.5-0.8B's text model as published: 24 layers (every 4th full attention: 6 KV layers), hidden
# 1024, 8 query / 2 KV heads of 256 with a quarter rotated, tied embeddings, vocab 248,320; the linear
# heads (16 key / 16 value of 128) and the MLP (3,584) are the family's, not read off that checkpoint.
QWEN35_08B = dict(
    vocab_size=248320,
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=3584,
    full_attention_interval=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)


def cache_root() -> str:
    return os.environ.get("EMBER_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ember", "bench"))


def build_folder(
    path: str, seed: int = 0, shape: dict = QWEN35_08B, arch: str = "Qwen3_5", tokenizer=None, device=None
) -> str:
    """The random HF folder (once): weights N(0, 0.02), norms at their identity, decays spread.
    arch: transformers' family, Qwen3_5 (Qwen3_5TextConfig / Qwen3_5ForCausalLM) or Qwen3Next;
    tokenizer(folder) writes the tokenizer files (default: Qwen's, from llama.cpp's vocab file);
    device: where the weights are drawn (scripts/gpu_check.py draws them on the GPU)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    from ember.bench.peers.llamacpp_convert import write_qwen_tokenizer

    torch.manual_seed(seed)
    config_cls = transformers.Qwen3NextConfig if arch == "Qwen3Next" else transformers.Qwen3_5TextConfig
    config = config_cls(**shape, dtype="bfloat16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of a big model
    try:
        with torch.device(device or "cpu"):
            model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-2.0, 1.5)
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()  # zero-centred norms: weight 0 is the identity
            else:
                p.normal_(0.0, 0.02)
    partial = path + ".partial"
    model.save_pretrained(partial)
    (tokenizer or write_qwen_tokenizer)(partial)
    os.replace(partial, path)
    return path


def build_gguf(folder: str) -> str:
    from ember.bench.peers.llamacpp_convert import convert

    out = folder.rstrip("/") + ".bf16.gguf"
    if not os.path.exists(out):
        convert(folder, out + ".partial", "bf16", ("--no-mtp",))
        os.replace(out + ".partial", out)
    return out


def main(args) -> None:
    folder = build_folder(args.model_dir or os.path.join(cache_root(), "qwen3.5-0.8b-shape-random"))
    gguf = build_gguf(folder) if "llamacpp" in args.peer else None
    logger.info("bench hybrid: %s (HF, ember and transformers), %s (llama.cpp)", folder, gguf)
    args.model, args.llamacpp_model, args.hf_model = folder, gguf, folder
    args.mtp, args.versus, args.baseline, args.judge, args.kind = False, None, None, False, "hybrid"
    args.title = (
        "hybrid: a random Qwen3.5-0.8B-shaped model, ember and transformers on its HF folder, llama.cpp on "
        "its GGUF (llama.cpp's converter, bf16: the same values), same threads"
    )
    compare.main(args)


def add_cli_args(p) -> None:
    """compare's flags, with this command's model folder and defaults."""
    compare.add_cli_args(p)
    p.add_argument("--model-dir", default=None, help="where the random HF folder is (built there if missing)")
    p.set_defaults(
        output="benchmarks/hybrid.md",
        decode_prompt="random",
        prompt_lens=[2000],
        num_prompts=16,
        decode_tokens=64,
        output_len=32,
        mtp=False,
        max_model_len=4096,
    )
