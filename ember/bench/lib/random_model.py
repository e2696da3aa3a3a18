"""Random-weight model folders of real shapes, written offline (no download, no tokenizer training).

A shape is a dict: arch, vocab, hidden, inter, layers, heads, kv_heads, head_dim, max_pos,
rope_theta, tie; MoE adds experts, top_k, moe_inter; AWQ adds awq_group; mtp_layers = n adds n
random MTP layers in the DeepSeek-V3 layout (model.layers.{L+j}.enorm/hnorm/eh_proj/shared_head.norm
+ a decoder block, config num_nextn_predict_layers), which `enable_mtp` loads. Used by
scripts/gpu_check.py (real shapes on a lent GPU) and `ember bench tp` (a model whose heads split).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile

import torch

QWEN3 = dict(arch="Qwen3ForCausalLM", vocab=151936, rope_theta=1e6, max_pos=40960)


def hf_config(s: dict) -> dict:
    cfg = dict(
        architectures=[s["arch"]],
        model_type="qwen3_moe" if "experts" in s else "qwen3",
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["inter"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=s["max_pos"],
        rms_norm_eps=1e-6,
        rope_theta=s["rope_theta"],
        tie_word_embeddings=s["tie"],
        attention_bias=False,
        torch_dtype="bfloat16",
        bos_token_id=None,
        eos_token_id=2,
    )
    if "experts" in s:
        cfg.update(
            num_experts=s["experts"],
            num_experts_per_tok=s["top_k"],
            moe_intermediate_size=s["moe_inter"],
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if s.get("mtp_layers"):
        cfg["num_nextn_predict_layers"] = s["mtp_layers"]
    if "awq_group" in s:
        cfg["torch_dtype"] = "float16"
        cfg["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": s["awq_group"],
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    return cfg


def write_tokenizer(path: str, vocab_size: int) -> None:
    """A word-level tokenizer with one token per model id ("t123"), so every sampled id decodes;
    built in memory, no training and no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "bos_token": None}, f)


def model_tensors(s: dict, device: torch.device):
    """(HF name, tensor) of a random model: N(0, 0.02) weights, unit norms; AWQ linears as
    random packed int4 (any int32 is a valid word) with scales giving weights of ~0.02."""
    H, D, V = s["hidden"], s["head_dim"], s["vocab"]
    dt = torch.float16 if "awq_group" in s else torch.bfloat16

    def rand(*shape):
        return (torch.randn(*shape, device=device, dtype=torch.float32) * 0.02).to(dt)

    def ones(n):
        return torch.ones(n, device=device, dtype=dt)

    def linear(prefix, out_f, in_f):
        if "awq_group" not in s:
            yield f"{prefix}.weight", rand(out_f, in_f)
            return
        G = s["awq_group"]
        words = lambda *shape: torch.randint(-(2**31), 2**31, shape, device=device, dtype=torch.int64).to(torch.int32)  # noqa: E731
        yield f"{prefix}.qweight", words(in_f, out_f // 8)
        yield f"{prefix}.qzeros", words(in_f // G, out_f // 8)
        # |q - z| ~ 5 on average: scales ~0.004 give weights of ~0.02
        yield f"{prefix}.scales", (torch.rand(in_f // G, out_f, device=device) * 0.004 + 0.002).half()

    def decoder_layer(p):
        """One decoder block's tensors under prefix p (model.layers.N)."""
        yield f"{p}.input_layernorm.weight", ones(H)
        yield f"{p}.post_attention_layernorm.weight", ones(H)
        yield f"{p}.self_attn.q_norm.weight", ones(D)
        yield f"{p}.self_attn.k_norm.weight", ones(D)
        yield from linear(f"{p}.self_attn.q_proj", s["heads"] * D, H)
        yield from linear(f"{p}.self_attn.k_proj", s["kv_heads"] * D, H)
        yield from linear(f"{p}.self_attn.v_proj", s["kv_heads"] * D, H)
        yield from linear(f"{p}.self_attn.o_proj", H, s["heads"] * D)
        if "experts" in s:
            E, I = s["experts"], s["moe_inter"]
            yield f"{p}.mlp.gate.weight", rand(E, H)
            yield f"{p}.mlp.experts.gate_up_proj", rand(E, 2 * I, H)  # transformers-5 fused names
            yield f"{p}.mlp.experts.down_proj", rand(E, H, I)
        else:
            yield from linear(f"{p}.mlp.gate_proj", s["inter"], H)
            yield from linear(f"{p}.mlp.up_proj", s["inter"], H)
            yield from linear(f"{p}.mlp.down_proj", H, s["inter"])

    yield "model.embed_tokens.weight", rand(V, H)
    if not s["tie"]:
        yield "lm_head.weight", rand(V, H)
    yield "model.norm.weight", ones(H)
    for i in range(s["layers"]):
        yield from decoder_layer(f"model.layers.{i}")
    for j in range(s.get("mtp_layers", 0)):  # DeepSeek-V3 layout: after the decoder, sharing embedding and head
        p = f"model.layers.{s['layers'] + j}"
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            yield f"{p}.{norm}.weight", ones(H)
        yield f"{p}.eh_proj.weight", rand(H, 2 * H)
        yield from decoder_layer(p)


def scratch_dir(need_bytes: int) -> str:
    """/dev/shm when it has room (no disk writes), else the temp dir."""
    for base in ("/dev/shm", tempfile.gettempdir()):
        try:
            if os.path.isdir(base) and shutil.disk_usage(base).free > need_bytes * 1.2 + (2 << 30):
                return tempfile.mkdtemp(prefix="ember-random-model-", dir=base)
        except OSError:
            continue
    return tempfile.mkdtemp(prefix="ember-random-model-")


def estimate_bytes(s: dict) -> int:
    H, D, V, L = s["hidden"], s["head_dim"], s["vocab"], s["layers"]
    attn = H * D * (2 * s["heads"] + 2 * s["kv_heads"])
    mlp = s["experts"] * 3 * H * s["moe_inter"] if "experts" in s else 3 * H * s["inter"]
    linear = (L + s.get("mtp_layers", 0)) * (attn + mlp)
    per = 0.5 + 2.5 / s["awq_group"] if "awq_group" in s else 2  # int4 + (int4 zero + fp16 scale) / G
    return int(linear * per + V * H * 2 * (1 if s["tie"] else 2))


def build_model(s: dict, device: torch.device) -> tuple[str, int]:
    """Write the random HF folder; returns (path, bytes). Tensors are generated on `device`
    (fast on a GPU) and saved in ~2 GB shards."""
    from safetensors.torch import save_file

    path = scratch_dir(estimate_bytes(s))
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    n = 0
    torch.manual_seed(0)

    def flush():
        nonlocal shard, size, n
        if shard:
            save_file(shard, os.path.join(path, f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
            n += 1
            shard, size = {}, 0

    try:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_config(s), f, indent=1)
        write_tokenizer(path, s["vocab"])
        for name, t in model_tensors(s, device):
            t = t.contiguous().cpu()
            shard[name] = t
            size += t.nbytes
            total += t.nbytes
            if size >= (2 << 30):
                flush()
        flush()
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)  # a half-written folder (disk full?) must not fill /dev/shm
        raise
    return path, total
