"""Write an ember model (dense float32, AWQ scales already folded in) as an AutoAWQ GEMM folder
that ember and vLLM both load (formats.md §1):

  config.json             the model's HF config + quantization_config (awq, 4 bits, group G, zero point, gemm)
  model.safetensors       HF names: every q/k/v/o/gate/up/down_proj (and MoE expert) Linear as
                          qweight/qzeros (int32) + scales (fp16); biases, norms, embed_tokens,
                          lm_head (when untied) and the MoE router in fp16
  tokenizer.json, tokenizer_config.json (chat_template, bos/eos/pad), generation_config.json

The fused qkv_proj / gate_up_proj are split back into their HF parts; each part quantizes on
its own rows, so the packing equals that of the fused weight.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch

from ember.errors import ModelLoadError
from ember.layers.moe import SparseMoeBlock
from ember.quant.awq_packing import pack_linear

# Files a Hugging Face folder's tokenizer is made of; copied verbatim from a folder source.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "generation_config.json",
)


def _linear(prefix: str, weight: torch.Tensor, bias: torch.Tensor | None, group_size: int):
    for k, t in pack_linear(weight, group_size).items():
        yield f"{prefix}.{k}", t
    if bias is not None:
        yield f"{prefix}.bias", bias


def _fused(prefix: str, linear, names: dict[str, str], group_size: int):
    """A fused Linear (qkv_proj / gate_up_proj) as its HF parts {shard id: HF name}."""
    for shard, name in names.items():
        rows = slice(linear.shard_offsets[shard], linear.shard_offsets[shard] + linear.shard_sizes[shard])
        yield from _linear(
            f"{prefix}.{name}", linear.weight[rows], None if linear.bias is None else linear.bias[rows], group_size
        )


def awq_tensors(model, group_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of the AWQ checkpoint of a dense ember model, quantizing by round-to-nearest."""
    cfg, m = model.cfg, model.model
    yield "model.embed_tokens.weight", m.embed_tokens.weight
    if not cfg.tie_word_embeddings:
        yield "lm_head.weight", model.lm_head.weight
    yield "model.norm.weight", m.norm.weight
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}"
        yield f"{p}.input_layernorm.weight", layer.input_layernorm.weight
        yield f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight
        attn = layer.self_attn
        if attn.qk_norm:
            yield f"{p}.self_attn.q_norm.weight", attn.q_norm.weight
            yield f"{p}.self_attn.k_norm.weight", attn.k_norm.weight
        yield from _fused(f"{p}.self_attn", attn.qkv_proj, {"q": "q_proj", "k": "k_proj", "v": "v_proj"}, group_size)
        yield from _linear(f"{p}.self_attn.o_proj", attn.o_proj.weight, attn.o_proj.bias, group_size)
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            yield f"{p}.mlp.gate.weight", mlp.gate.weight
            ex, I = mlp.experts, mlp.experts.intermediate_size
            for e in range(ex.num_experts):
                q = f"{p}.mlp.experts.{e}"
                yield from _linear(f"{q}.gate_proj", ex.w13[e, :I], None, group_size)
                yield from _linear(f"{q}.up_proj", ex.w13[e, I:], None, group_size)
                yield from _linear(f"{q}.down_proj", ex.w2[e], None, group_size)
        else:
            yield from _fused(f"{p}.mlp", mlp.gate_up_proj, {"gate": "gate_proj", "up": "up_proj"}, group_size)
            yield from _linear(f"{p}.mlp.down_proj", mlp.down_proj.weight, mlp.down_proj.bias, group_size)


def modules_not_converted(model) -> list[str] | None:
    """Full names of the MoE routers (kept dense); None for a dense model, as AutoAWQ writes.
    Full names, because vLLM matches these as substrings ("mlp.gate" would catch gate_up_proj)."""
    names = [
        f"model.layers.{i}.mlp.gate"
        for i, layer in enumerate(model.model.layers)
        if isinstance(layer.mlp, SparseMoeBlock)
    ]
    return names or None


def awq_config(raw: dict, group_size: int, not_converted: list[str] | None) -> dict:
    cfg = {k: v for k, v in raw.items() if k not in ("quantization_config", "_name_or_path")}
    cfg["torch_dtype"] = "float16"
    if "dtype" in cfg:  # transformers 5 writes "dtype"
        cfg["dtype"] = "float16"
    cfg["quantization_config"] = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": not_converted,
    }
    return cfg


def write_tokenizer(tokenizer, out: str, bos_token_id=None) -> None:
    """tokenizer.json + tokenizer_config.json + generation_config.json from an ember Tokenizer
    (e.g. one built from a GGUF file); Tokenizer.from_folder(out) reads the same tokenizer back.

    BOS/EOS adding stays in tokenizer.json's post-processor (no add_bos_token key), so both
    ember and transformers tokenize exactly as the source did."""
    tokenizer.hf_tokenizer.save(os.path.join(out, "tokenizer.json"))
    tok_cfg: dict = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **tokenizer.special_tokens,
    }
    templates = tokenizer.chat_templates
    if list(templates) == ["default"]:
        tok_cfg["chat_template"] = templates["default"]
    elif templates:
        tok_cfg["chat_template"] = [{"name": k, "template": v} for k, v in templates.items()]
    _write_json(os.path.join(out, "tokenizer_config.json"), tok_cfg)
    eos = tokenizer.eos_token_ids
    gen = {
        "bos_token_id": tokenizer.bos_token_id if tokenizer.bos_token_id is not None else bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else eos,
    }
    _write_json(os.path.join(out, "generation_config.json"), {k: v for k, v in gen.items() if v is not None})


def write_awq_folder(loaded, out: str, group_size: int) -> dict[str, torch.Tensor]:
    """Pack `loaded.model` (a LoadedModel, dense float32) into an AutoAWQ folder at `out`; returns the tensors."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    model = loaded.model
    tensors = {}
    with torch.no_grad():
        for name, t in awq_tensors(model, group_size):
            t = t if t.dtype == torch.int32 else t.to(torch.float16)
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ModelLoadError(f"{name} does not fit in float16 (inf or NaN after the cast); cannot export it")
            tensors[name] = t.contiguous()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    _write_json(
        os.path.join(out, "config.json"), awq_config(loaded.model_config.raw, group_size, modules_not_converted(model))
    )
    if os.path.isdir(loaded.path):  # an HF folder: its tokenizer files, verbatim
        for f in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(loaded.path, f)):
                shutil.copyfile(os.path.join(loaded.path, f), os.path.join(out, f))
    else:
        write_tokenizer(loaded.tokenizer, out, loaded.model_config.bos_token_id)
    return tensors


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
