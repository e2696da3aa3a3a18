"""Qwen's official FP8 checkpoints (`quantization_config.quant_method: "fp8"`), kept in fp8 with their scales.

The format (Qwen3-*-FP8, Qwen3.8-27B-FP8, Qwen3.8-Flash-Next-FP8; DeepSeek's, whose layout they follow):
`{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
"modules_to_not_convert": [...]}`; each quantized Linear holds `weight` float8_e4m3fn [out, in] and
`weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)], the real weight being weight * scale_inv per
block. Embeddings, the LM head, norms, routers, shared_expert_gate and usually linear_attn's in_proj_a/b stay
bf16; qwen4_exp's n-gram table shards may be fp8 with a per-tensor `weight_scale` (ember.layers.ple).

Which modules are fp8 is read from the checkpoint itself (its safetensors headers: names, dtypes, shapes),
not from modules_to_not_convert, whose spellings vary between exports (VL prefixes, fused names). That
read also checks, before anything is built, that every fp8 weight has its scale and that each scale's shape
fits its weight's blocks (a ModelLoadError naming the tensor otherwise).

Where ember's layer is quantized (every checkpoint matrix it fuses is fp8), the weight stays fp8 and its
scales stay the checkpoint's (ember.quant.fp8_linear; the GEMVs: ember.kernels.cpu_fp8_gemv on CPU,
ember.kernels.triton_fp8 on CUDA). A checkpoint fp8 matrix whose ember layer is dense (a fused layer with
some parts bf16, a projection ember builds without a quant hook) is dequantized to float32 as it streams
in, and said once in the log.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import struct

import torch

from ember.errors import ModelLoadError, UnsupportedModelError
from ember.quant import fp8_blocks
from ember.quant.quant_config import QuantConfig

log = logging.getLogger("ember")
SCALE = ".weight_scale_inv"  # a Linear's block scales
FUSED_SCALE = "_scale_inv"  # a fused 3-D experts tensor's ("experts.gate_up_proj_scale_inv")
TENSOR_SCALE = ".weight_scale"  # a per-tensor scale (qwen4_exp's fp8 n-gram table shards)
# ember's layer -> the checkpoint modules it may be built from, in the layouts seen (the first layout the
# checkpoint holds decides); Gated DeltaNet asks for its checkpoint projections by name as well.
LAYOUTS = {
    "qkv_proj": (("q_proj", "k_proj", "v_proj"), ("qkv_proj",)),
    "gate_up_proj": (("gate_proj", "up_proj"), ("gate_up_proj",)),
    "in_proj_qkvz": (("in_proj_qkv", "in_proj_z"), ("in_proj_qkvz",)),
    "in_proj_qkv": (("in_proj_qkv",), ("in_proj_qkvz",)),
    "in_proj_z": (("in_proj_z",), ("in_proj_qkvz",)),
    "in_proj_ba": (("in_proj_b", "in_proj_a"), ("in_proj_ba",)),
    "in_proj_b": (("in_proj_b",), ("in_proj_ba",)),
    "in_proj_a": (("in_proj_a",), ("in_proj_ba",)),
}


def text_name(name: str) -> str:
    """A VL checkpoint's text-model name as ember's layers are prefixed (model.language_model.* -> model.*)."""
    return name.replace("model.language_model.", "model.", 1) if name.startswith("model.language_model.") else name


def module_key(name: str) -> str | None:
    """The matrix a checkpoint weight or scale name belongs to ("...q_proj.weight" -> "...q_proj";
    "...experts.gate_up_proj" -> itself), or None for other tensors (biases, norms' vectors stay None by shape)."""
    for suffix in (SCALE, TENSOR_SCALE, ".weight"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    if name.endswith(FUSED_SCALE):
        return name[: -len(FUSED_SCALE)]
    return name


def _files(folder: str) -> list[str]:
    """The folder's .safetensors files (those its index lists, else all); the loader checks them further."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f).get("weight_map", {}).values()))
        return [os.path.join(folder, n) for n in names if os.path.exists(os.path.join(folder, n))]
    return sorted(glob.glob(os.path.join(folder, "*.safetensors")))


def read_headers(path: str) -> dict[str, tuple[str, list[int]]]:
    """name -> (safetensors dtype, shape) of every tensor in the folder, from the files' headers only."""
    out = {}
    for file in _files(path):
        try:
            with open(file, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(size))
        except (OSError, ValueError, struct.error) as e:
            raise ModelLoadError(f"{file} is not a readable safetensors file ({e}); download it again") from None
        for name, info in header.items():
            if name != "__metadata__":
                out[name] = (info["dtype"], list(info["shape"]))
    return out


class FP8Config(QuantConfig):
    name = "fp8"

    def __init__(self, block: tuple[int, int], headers: dict[str, tuple[str, list[int]]]):
        self.block = block
        self.fp8: dict[str, list[int]] = {}  # checkpoint matrix (text name) -> its fp8 weight's shape
        self.present: set[str] = set()  # every checkpoint matrix (text name), whatever its dtype
        self.kept: set[str] = set()  # fp8 matrices whose ember layer keeps them fp8
        self.kept_experts: set[str] = set()  # "model.layers.N.mlp.experts" prefixes kept fp8
        self._check(headers)

    @classmethod
    def from_checkpoint(cls, path: str, settings: dict) -> "FP8Config":
        fmt = str(settings.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise UnsupportedModelError(f"this FP8 checkpoint stores {fmt!r} weights; ember reads e4m3 (fmt 'e4m3')")
        block = settings.get("weight_block_size")
        if not block or len(block) != 2 or min(int(b) for b in block) <= 0:
            raise UnsupportedModelError(
                f"this FP8 checkpoint has weight_block_size {block!r}; ember reads block-wise FP8 (Qwen's and "
                "DeepSeek's [128, 128] layout). Per-tensor or per-channel FP8 exports are not supported: use the "
                "bf16 model or its official FP8 release"
            )
        return cls((int(block[0]), int(block[1])), read_headers(path))

    def _check(self, headers: dict[str, tuple[str, list[int]]]) -> None:
        """Every fp8 weight has its scale, of the shape its blocks need (the whole checkpoint, before loading)."""
        scaled = {module_key(n): (n, shape) for n, (_, shape) in headers.items() if n.endswith(FUSED_SCALE)}
        per_tensor = {module_key(n) for n in headers if n.endswith(TENSOR_SCALE)}
        for name, (dtype, shape) in headers.items():
            key = module_key(name)
            if name.endswith(FUSED_SCALE) or len(shape) < 2 or name.endswith(TENSOR_SCALE):
                continue
            self.present.add(text_name(key))
            if dtype != "F8_E4M3":
                continue
            if key in per_tensor and key not in scaled:
                continue  # a row table read with its per-tensor scale (ember.layers.ple)
            if key not in scaled:
                wanted = SCALE if name.endswith(".weight") else FUSED_SCALE
                table = f" (or a per-tensor {key}{TENSOR_SCALE})" if "ngram_embedding" in key else ""
                raise ModelLoadError(
                    f"{name} is float8_e4m3fn but the checkpoint has no {key}{wanted}{table}; "
                    "the checkpoint is incomplete (download it again)"
                )
            scale_name, scale_shape = scaled.pop(key)
            want = [
                *shape[:-2],
                fp8_blocks.blocks(shape[-2], self.block[0]),
                fp8_blocks.blocks(shape[-1], self.block[1]),
            ]
            if list(scale_shape) != want:
                raise ModelLoadError(
                    f"{scale_name} has shape {list(scale_shape)}, but {name} {shape} in blocks of {list(self.block)} "
                    f"(weight_block_size) needs {want}; the scales do not belong to this weight"
                )
            self.fp8[text_name(key)] = shape
        if scaled:
            name = next(iter(scaled.values()))[0]
            raise ModelLoadError(f"{name} scales a weight the checkpoint does not hold as fp8 ({len(scaled)} such)")

    def _layout(self, prefix: str) -> list[str] | None:
        """The checkpoint matrices ember's layer `prefix` is built from (the first layout present), or None."""
        parent, _, leaf = prefix.rpartition(".")
        for parts in LAYOUTS.get(leaf, ((leaf,),)):
            names = [f"{parent}.{p}" for p in parts]
            if all(n in self.present for n in names):
                return names
        return None

    def linear_method(self, prefix: str):
        names = self._layout(prefix)
        if names is None or not all(n in self.fp8 for n in names):
            return None  # dense: bf16 in the checkpoint (its fp8 parts, if any, dequantize as they load)
        from ember.quant.fp8_linear import FP8LinearMethod

        self.kept.update(names)
        return FP8LinearMethod(self.block, self.kernels)

    def experts_method(self, prefix: str):
        if not any(k.startswith(prefix + ".") for k in self.fp8):
            return None
        from ember.quant.fp8_experts import FP8ExpertsMethod

        self.kept_experts.add(prefix)
        return FP8ExpertsMethod(self.block, self.kernels)

    def _is_kept(self, key: str) -> bool:
        key = text_name(key)
        if key in self.kept:
            return True
        head, sep, _ = key.partition(".experts.")
        return bool(sep) and head + ".experts" in self.kept_experts

    def checkpoint_weights(self, weights):
        """The checkpoint's (name, tensor) stream as ember's layers take it: a kept matrix's scales expanded to
        one row per weight row (ember.quant.fp8_blocks), so they follow their rows through every split and
        fuse; an fp8 matrix ember keeps dense dequantized to float32 (its weight and scale paired up)."""
        waiting: dict[str, tuple[str, torch.Tensor]] = {}  # a dense-kept matrix's first half
        dense = []
        for name, tensor in weights:
            key = module_key(name)
            is_scale = name.endswith(FUSED_SCALE)
            if text_name(key) not in self.fp8 or name.endswith(TENSOR_SCALE):
                yield name, tensor
            elif self._is_kept(key):
                shape = self.fp8[text_name(key)]
                yield name, (fp8_blocks.expand_rows(tensor, shape[-2], self.block[0]) if is_scale else tensor)
            elif key not in waiting:
                waiting[key] = (name, tensor)
            else:
                (n1, t1), (n2, t2) = waiting.pop(key), (name, tensor)
                (wname, w), (_, s) = ((n1, t1), (n2, t2)) if n2.endswith(FUSED_SCALE) else ((n2, t2), (n1, t1))
                dense.append(wname)
                yield wname, fp8_blocks.dequantize_checkpoint(w, s, self.block)
        if waiting:
            raise ModelLoadError(f"{next(iter(waiting.values()))[0]}: its weight or scale never came in the stream")
        if dense:
            log.info(
                "fp8 checkpoint: %d fp8 matrices that ember runs dense were dequantized at load (e.g. %s)",
                len(dense),
                dense[0],
            )


def dequantized_stream(folder: str, weights):
    """A folder's (name, tensor) stream for layers ember builds dense (the MTP layers: ember.spec.mtp_weights):
    where the folder is an FP8 checkpoint, every fp8 weight arrives dequantized to float32 with its scale
    consumed; otherwise the stream as it is."""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            settings = json.load(f).get("quantization_config") or {}
    except (OSError, ValueError):
        settings = {}
    if str(settings.get("quant_method", "")).lower() != "fp8":
        return weights
    return FP8Config.from_checkpoint(folder, settings).checkpoint_weights(weights)
