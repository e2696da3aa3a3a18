"""Resolve a model argument (HF folder, .gguf file, or nothing = the embedded default) into
a loaded model, its config and its tokenizer."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ember.config.model_config import ModelConfig
from ember.errors import ConfigError, ModelLoadError
from ember.kernels.cpu_kernels import CpuKernels

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: object
    path: str
    format: str  # "gguf" | "safetensors"
    quantization: str  # "none" | "awq" | "gguf": how the weights are held in memory
    num_parameters: int
    weight_bytes: int  # bytes of the weights as held in memory
    load_seconds: float
    # bytes left in the checkpoint's mapping, read by row (qwen4_exp's n-gram table): not in weight_bytes
    mapped_weight_bytes: int = 0
    # routed experts kept in host memory as views of the file's mapping (--cpu-moe / --n-cpu-moe): not in
    # weight_bytes either; resident only as far as steps touch them
    mapped_expert_bytes: int = 0
    placement: object | None = None  # the ExpertPlacement the model was built with (ember.layers.expert_placement)


def resolve_model_path(model: str | None) -> str:
    if model is None:
        from ember.default_model import default_model_path

        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.exists(path):
        raise ModelLoadError(
            f"model {model!r} not found: give a Hugging Face model folder or a .gguf file on this machine "
            "(ember never downloads weights), or omit it to use the embedded default model"
        )
    return path


@dataclass
class _OpenCheckpoint:
    """A checkpoint opened for loading: what the model is built from, and its weights still to read."""

    model_config: ModelConfig
    quant_config: object | None  # a QuantConfig, or None: dense weights
    tokenizer: object | None  # a GGUF file carries one; a folder's is read by load_model
    weights: Iterable  # (name, tensor) pairs, read lazily as the model loads them
    format: str  # "gguf" | "safetensors"
    placement: object | None = None  # ExpertPlacement (None: everything on the device)


def load_model(
    model: str | None,
    tokenizer_path: str | None,
    dtype: torch.dtype,
    device: torch.device,
    attention_backend: str = "auto",
    quantization: str | None = "auto",
    kernels: CpuKernels | None = None,
    shapes_only: bool = False,
    placement=None,
) -> LoadedModel:
    """kernels: the CPU kernels the model's layers may use (default: every one that applies here);
    the attention backend named is built with them. shapes_only: a package worker's model, built for its
    graph and never served: each weight's pages are given back once loaded (ember.loader.shapes_only).
    placement: a PlacementConfig (--cpu-moe, --n-cpu-moe, --ple-offload: ember.layers.expert_placement)."""
    from ember.kernels import get_attention_backend
    from ember.layers.expert_placement import building
    from ember.loader.tokenizer import Tokenizer
    from ember.models.registry import get_model_class
    from ember.quant import process_weights_after_loading

    t0 = time.perf_counter()
    path = resolve_model_path(model)
    opener = _open_gguf if os.path.isfile(path) else _open_safetensors
    ckpt = opener(path, quantization, dtype, device, kernels, placement)
    tokenizer = ckpt.tokenizer
    if tokenizer_path is not None:
        tokenizer = Tokenizer.from_folder(tokenizer_path)
    elif tokenizer is None:
        tokenizer = Tokenizer.from_folder(path)

    model_config, quant_config = ckpt.model_config, ckpt.quant_config
    model_cls = get_model_class(model_config.architecture)
    with torch.device(device), building(ckpt.placement):
        net = model_cls(
            model_config,
            dtype=dtype,
            device=device,
            quant_config=quant_config,
            kernels=kernels,
            attn_backend=get_attention_backend(attention_backend, device, kernels),
        )
    if shapes_only:
        from ember.loader.shapes_only import ShapesOnlyLoad

        released = ShapesOnlyLoad(net)
        net.load_weights(released.stream(ckpt.weights))
        process_weights_after_loading(net, after_each=released.after_hook)
        released.finish()
    else:
        net.load_weights(ckpt.weights)
        process_weights_after_loading(net)
    net.eval()
    num_params = _logical_parameter_count(net, model_cls, model_config, dtype, quant_config)
    return LoadedModel(
        net,
        model_config,
        tokenizer,
        path,
        ckpt.format,
        quant_config.name if quant_config else "none",
        num_params,
        resident_weight_bytes(net),
        time.perf_counter() - t0,
        sum(m.mapped_weight_bytes() for m in net.modules() if hasattr(m, "mapped_weight_bytes")),
        sum(m.mapped_expert_bytes() for m in net.modules() if hasattr(m, "mapped_expert_bytes")),
        ckpt.placement,
    )


def _placement(config, model_config: ModelConfig, dtype: torch.dtype, device: torch.device, kernels):
    """The ExpertPlacement of a PlacementConfig for this model (None: nothing placed apart)."""
    if config is None:
        return None
    from ember.layers.expert_placement import resolve_placement
    from ember.quant.mapped_experts import MappedExperts

    fused = (kernels or CpuKernels()).fused_elementwise
    # beside a GPU (whose model runs no CPU kernels) the host experts take every CPU kernel that runs here
    host = None if torch.device(device).type == "cpu" else CpuKernels()
    return resolve_placement(config, model_config, device, dtype, MappedExperts, fused, host)


def _open_gguf(
    path: str,
    quantization: str | None,
    dtype: torch.dtype,
    device: torch.device,
    kernels: CpuKernels | None,
    placement=None,
) -> _OpenCheckpoint:
    from tqdm import tqdm

    from ember.loader.gguf import GGUFCheckpoint
    from ember.quant import resolve_quant_config

    ckpt = GGUFCheckpoint(path)
    model_config = ModelConfig.from_dict(ckpt.config)
    placed = _placement(placement, model_config, dtype, device, kernels)
    matrix_types = {t for _, t, _, dims in ckpt.loaded_tensor_infos() if dims >= 2}
    half_only = bool(matrix_types & {"BF16", "F16"}) and matrix_types <= {"BF16", "F16", "F32"}
    quantization = _gguf_quantization(quantization, dtype, device, kernels, half_only, _block_only(matrix_types))
    quant_config = resolve_quant_config(quantization, path, model_config.raw, kernels)
    # disable=None: a bar on a terminal, silence in logs and CI (as iter_safetensors does).
    # packed: quantized tensors arrive as GGUFTensor blocks for the gguf QuantMethods.
    weights = tqdm(
        ckpt.iter_weights(packed=quant_config is not None, mapped=placed and placed.mapped_names()),
        total=None if model_config.num_experts else len(ckpt.tensor_names),
        desc="Loading weights",
        unit="tensor",
        disable=None,
    )
    return _OpenCheckpoint(model_config, quant_config, ckpt.tokenizer(), weights, "gguf", placed)


def _block_only(matrix_types: set[str]) -> bool:
    """Whether the file has matrices of a type only the block kernels keep packed (BlockPart: Q2_K, Q3_K, the
    IQ types), which dequantized would take 4-16x their bytes."""
    from ember.quant.gguf_block_part import BLOCK_TYPE_NAMES

    return bool(matrix_types & set(BLOCK_TYPE_NAMES))


def _gguf_quantization(
    quantization: str | None,
    dtype: torch.dtype,
    device: torch.device,
    kernels: CpuKernels | None,
    half_only: bool = False,
    block_only: bool = False,
) -> str | None:
    """--quantization for a GGUF file: `auto` in float32 on a CPU without the tiled GEMV dequantizes,
    but for a file of BF16 / F16 matrices only, which HalfPart keeps 16-bit where it can
    (half_only: the file's matrices are BF16 / F16, and F32 for the small ones), and a file with block-only
    types (block_only), which the block kernels run in float32 as they lie."""
    from ember.quant.gguf_quant import HalfPart, TiledPart

    if (
        (quantization or "auto") == "auto"
        and device.type == "cpu"
        and dtype == torch.float32
        and not TiledPart.usable(dtype, device, kernels)
        and not (half_only and HalfPart.usable(dtype, device, kernels))
        and not block_only
    ):
        # torch vectorizes its CPU int4 kernel for bf16 only (fp32 is ~50x slower than a dense
        # fp32 GEMV), so a float32 run without the tiled GEMV's AVX2 build is faster dequantized;
        # --quantization gguf still forces packing.
        logger.info(
            "GGUF in float32 on CPU: dequantizing (torch's int4 kernel is fast in bfloat16 only, and "
            "the tiled GEMV is off or not built here); pass --dtype bfloat16 to keep the weights packed"
        )
        return "none"
    return quantization


def _open_safetensors(
    path: str,
    quantization: str | None,
    dtype: torch.dtype,
    device: torch.device,
    kernels: CpuKernels | None,
    placement=None,
) -> _OpenCheckpoint:
    from ember.distributed.parallel_state import get_tp_rank_size
    from ember.loader.weights import iter_safetensors
    from ember.quant import resolve_quant_config
    from ember.quant.half_weights import half_weights_config

    model_config = ModelConfig.from_folder(path)
    quant_config = resolve_quant_config(quantization, path, model_config.raw, kernels)
    if quant_config is None and (quantization or "auto") == "auto":  # bf16 matrices stay 16-bit in float32
        tp_size = get_tp_rank_size()[1]
        quant_config = half_weights_config(model_config.torch_dtype, dtype, device, kernels, tp_size)
    # weights the model reads only by rows (MAPPED_WEIGHTS: name fragments) stay in the file's mapping
    from ember.models.registry import get_model_class

    fragments = getattr(get_model_class(model_config.architecture), "MAPPED_WEIGHTS", ())
    placed = _placement(placement, model_config, dtype, device, kernels)
    experts = placed.mapped_names() if placed is not None and placed.host_layers else None
    if experts is not None and quant_config is not None and quant_config.name != "half":
        raise ConfigError(
            f"--cpu-moe / --n-cpu-moe keep a checkpoint's experts mapped as the file holds them; {path} holds "
            f"{quant_config.name} experts, which they do not run: use a bf16 folder or a .gguf file"
        )

    def mapped(name: str) -> bool:
        return any(f in name for f in fragments) or (experts is not None and experts(name))

    weights = iter_safetensors(path, mapped=mapped if fragments or experts else None)
    if quant_config is not None:  # e.g. an FP8 checkpoint's scales, expanded as they stream in (ember.quant.fp8)
        weights = quant_config.checkpoint_weights(weights)
    return _OpenCheckpoint(model_config, quant_config, None, weights, "safetensors", placed)


def _logical_parameter_count(
    net: torch.nn.Module, model_cls, model_config: ModelConfig, dtype: torch.dtype, quant_config
) -> int:
    """The model's parameter count as if dense and whole, however this rank holds it."""
    from ember.distributed.parallel_state import get_tp_rank_size, sharding

    if quant_config is None and get_tp_rank_size()[1] == 1:
        return count_parameters(net)
    # packed or TP-sharded weights hide the logical count: count a whole dense twin on the meta device
    with sharding(0, 1):
        return count_parameters(model_cls(model_config, dtype=dtype, device="meta"))


def count_parameters(net: torch.nn.Module) -> int:
    params = {id(p): p for p in net.parameters()}.values()  # tied weights counted once
    return sum(p.numel() for p in params)


def resident_weight_bytes(net: torch.nn.Module) -> int:
    """Bytes the weights occupy in memory: parameters and persistent-or-not buffers (packed int4,
    scales), each storage counted once. The rotary cos/sin table is not a weight."""
    seen, total = set(), 0
    # and tensors a module holds outside its parameters (a PLE's n-gram table shards: ember.layers.ple)
    held = [("", t) for m in net.modules() for t in getattr(m, "held_weights", lambda: [])()]
    for name, t in list(net.named_parameters()) + list(net.named_buffers()) + held:
        if name.endswith(("cos_sin_cache", "inv_freq")) or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total
