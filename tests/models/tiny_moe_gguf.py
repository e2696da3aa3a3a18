"""A tiny Qwen3-MoE GGUF file whose routed experts are of three block types (gate Q8_0, up Q4_K, down Q6_K,
as Q4_K_M files mix them), with a small byte-level vocabulary in its metadata, so that LLM() serves it
as it is: the file the expert-placement tests load (tests/engine/test_expert_placement.py)."""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType as T

from tests.quant.test_gguf_packed import random_blocks

ARCH = "qwen3moe"


def _tokens(vocab: int) -> list[str]:
    """vocab distinct tokens of GPT-2's byte alphabet (the file's tokenizer needs no merges to read ids)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    return alphabet[:vocab] + [f"<t{i}>" for i in range(max(0, vocab - len(alphabet)))]


def tiny_moe_gguf(
    path: str,
    *,
    layers: int = 2,
    experts: int = 8,
    top_k: int = 2,
    hidden: int = 256,
    moe_ffn: int = 256,
    vocab: int = 256,
    expert_types: tuple = (T.Q8_0, T.Q4_K, T.Q6_K),
    seed: int = 0,
    fast: bool = False,
    router_std: float = 1.0,
) -> str:
    """Write the file at `path` (hidden and moe_ffn multiples of 256: the K-quants' super-blocks). fast: Q8_0
    experts drawn as random blocks directly (hundreds of MB in a second; gguf-py's quantizer takes minutes);
    router_std: the router's weights (small: near-uniform routing, every expert chosen by some token)."""
    heads, kv, hd = 4, 2, hidden // 4
    rng = np.random.default_rng(seed)
    seeds = iter(range(seed * 1000, seed * 1000 + 1000))

    def q(qtype, rows, cols, std=0.05):
        make = q8_0_blocks if qtype == T.Q8_0 and fast else random_blocks
        return qtype, make(qtype, rows, cols, next(seeds), std)

    def norm(n):
        return T.F32, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def stacked(qtype, rows, cols):
        make = q8_0_blocks if qtype == T.Q8_0 and fast else random_blocks
        return qtype, make(qtype, experts * rows, cols, next(seeds), 0.3).reshape(experts, rows, -1)

    tensors = {"token_embd.weight": q(T.Q8_0, vocab, hidden, 1.0), "output_norm.weight": norm(hidden)}
    for b in range(layers):
        p = f"blk.{b}."
        tensors |= {
            p + "attn_norm.weight": norm(hidden),
            p + "attn_q.weight": q(T.Q8_0, heads * hd, hidden),
            p + "attn_k.weight": q(T.Q8_0, kv * hd, hidden),
            p + "attn_v.weight": q(T.Q8_0, kv * hd, hidden),
            p + "attn_output.weight": q(T.Q8_0, hidden, heads * hd),
            p + "attn_q_norm.weight": norm(hd),
            p + "attn_k_norm.weight": norm(hd),
            p + "ffn_norm.weight": norm(hidden),
            p + "ffn_gate_inp.weight": (
                T.F32,
                (router_std * rng.standard_normal((experts, hidden))).astype(np.float32),
            ),
            p + "ffn_gate_exps.weight": stacked(expert_types[0], moe_ffn, hidden),
            p + "ffn_up_exps.weight": stacked(expert_types[1], moe_ffn, hidden),
            p + "ffn_down_exps.weight": stacked(expert_types[2], hidden, moe_ffn),
        }
    w = gguf.GGUFWriter(str(path), ARCH)
    for key, value in {
        "block_count": layers,
        "context_length": 1024,
        "embedding_length": hidden,
        "feed_forward_length": moe_ffn,
        "attention.head_count": heads,
        "attention.head_count_kv": kv,
        "attention.key_length": hd,
        "attention.value_length": hd,
        "expert_count": experts,
        "expert_used_count": top_k,
        "expert_feed_forward_length": moe_ffn,
        "vocab_size": vocab,
    }.items():
        w.add_uint32(f"{ARCH}.{key}", value)
    w.add_float32(f"{ARCH}.rope.freq_base", 10000.0)
    w.add_float32(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_array("tokenizer.ggml.tokens", _tokens(vocab))
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    for name, (qtype, array) in tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype if array.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def q8_0_blocks(qtype, rows: int, cols: int, seed: int, std: float) -> np.ndarray:
    """uint8 [rows, cols / 32 * 34] of Q8_0 blocks: a float16 scale std / 64, then 32 random int8 codes."""
    rng = np.random.default_rng(seed)
    blocks = np.frombuffer(bytearray(rng.bytes(rows * cols // 32 * 34)), dtype=np.uint8).reshape(-1, 34)
    blocks[:, 0:2] = np.full((len(blocks), 1), std / 64, dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, length).tolist()
