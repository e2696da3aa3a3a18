"""Write a block-wise FP8 checkpoint from a saved HF folder the way Qwen's FP8 releases are made, and its twin.

The FP8 folder: every Linear weight ("..._proj.weight", the hyper-connection and indexer projections
included) as float8_e4m3fn with `weight_scale_inv` float32 per `block` (each block's absmax mapped to 448),
except what Qwen keeps bf16: embeddings, lm_head, norms, the MoE router (mlp.gate), shared_expert_gate and
Gated DeltaNet's in_proj_a / in_proj_b (listed in modules_to_not_convert); qwen4_exp's n-gram table shards
as fp8 with a per-tensor `weight_scale`. config.json gets Qwen's quantization_config.

The twin: the same model with every quantized tensor replaced by its dequantized value (weight * scale) in
float32, written as a plain checkpoint: exactly the weights the FP8 folder means, so ember on the two may
differ only by the order of float32 sums.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from ember.quant import fp8_blocks

KEPT_DENSE = ("embed_tokens", "lm_head", "norm", "mlp.gate.", "shared_expert_gate", "in_proj_a.", "in_proj_b.")


def quantized(name: str, tensor: torch.Tensor) -> bool:
    if tensor.dim() != 2 or not name.endswith(".weight") or "ngram_embedding" in name:
        return False
    return not any(k in name for k in KEPT_DENSE)


def write_fp8_pair(src: str, fp8_dir: str, twin_dir: str, block: tuple[int, int]) -> tuple[str, str]:
    """src: a saved HF folder (one model.safetensors) -> (the FP8 folder, its dequantized float32 twin)."""
    for d in (fp8_dir, twin_dir):
        shutil.copytree(src, d, dirs_exist_ok=True)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    fp8, twin, skipped = {}, {}, set()
    for name, t in tensors.items():
        if quantized(name, t):
            q, s = fp8_blocks.quantize(t, block)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            twin[name] = fp8_blocks.dequantize_checkpoint(q, s, block)
        elif "ngram_embedding" in name and name.endswith(".weight"):
            scale = (t.abs().amax().float() / fp8_blocks.FP8_MAX).reshape(())
            q = (t.float() / scale).clamp(-fp8_blocks.FP8_MAX, fp8_blocks.FP8_MAX).to(fp8_blocks.FP8_DTYPE)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale"] = q, scale
            twin[name] = q.float() * scale
        else:
            fp8[name] = twin[name] = t.float() if t.is_floating_point() else t
            if t.dim() == 2 and name.endswith(".weight"):
                skipped.add(name.removesuffix(".weight"))
    save_file({k: v.contiguous() for k, v in fp8.items()}, os.path.join(fp8_dir, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in twin.items()}, os.path.join(twin_dir, "model.safetensors"))
    _edit_config(fp8_dir, block, sorted(skipped))
    _edit_config(twin_dir, None, [])
    return fp8_dir, twin_dir


def _edit_config(folder: str, block, not_converted: list[str]) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["torch_dtype"] = cfg["dtype"] = "float32" if block is None else "bfloat16"
    if block is not None:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": not_converted,
        }
    with open(path, "w") as f:
        json.dump(cfg, f)
