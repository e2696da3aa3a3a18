"""The second step of every engine start-up: load the model (this rank's shard under tensor
parallelism) and decide its second weight copies (ember.quant.weight_copies).

Rank 0 and the tensor-parallel workers call the same function with the same config, so every
rank holds the same kind of weights and runs the same kernels (their numerics agree).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch

from ember.config import CPU_DENSE_COPY_FRACTION
from ember.engine.startup.cpu_malloc import release_freed_memory
from ember.engine.startup.device import DeviceSetup
from ember.errors import ConfigError
from ember.loader.model_loader import LoadedModel, load_model
from ember.platform import available_ram_bytes
from ember.quant.weight_copies import dense_copy_bytes, enable_dense_copy, enable_int8_decode, packed_layers


@dataclass(frozen=True)
class WeightCopies:
    int8_decode_bytes: int = 0  # an int8 copy of dense weights for decode-sized steps
    dense_copy_bytes: int = 0  # a dense copy of packed weights for many-row steps

    def note(self) -> str:
        if self.int8_decode_bytes:
            return f" (+{self.int8_decode_bytes / 1e6:.1f} MB int8 decode copy)"
        if self.dense_copy_bytes:
            return f" (+{self.dense_copy_bytes / 1e6:.1f} MB dense copy for batches)"
        return ""


def load_weights(
    config, setup: DeviceSetup, quantization: str, tensor_parallel: bool = False
) -> tuple[LoadedModel, WeightCopies]:
    """The model as this rank holds it (call inside parallel_state.sharding under TP), with its copies."""
    load = config.load_config
    shapes_only = builds_packages_only(config)
    loaded = load_model(
        load.model,
        load.tokenizer,
        setup.dtype,
        setup.device,
        setup.attention_backend,
        quantization,
        setup.kernels,
        shapes_only=shapes_only,
        placement=config.placement_config,
    )
    copies = WeightCopies(int8_decode(config, setup, loaded), dense_copy(config, setup, loaded, tensor_parallel))
    if shapes_only and (copies.int8_decode_bytes or copies.dense_copy_bytes):  # copies of zeros, given back too
        from ember.loader.shapes_only import release_module_pages

        release_module_pages(loaded.model)
    if setup.device.type == "cpu":  # the reader's metadata and the loader's staging copies, freed, leave RSS
        gc.collect()
        release_freed_memory()
    return loaded, copies


def builds_packages_only(config) -> bool:
    """Whether this process is a package worker that builds ahead-of-time packages and nothing else: its
    model is loaded for its shapes only (ember.loader.shapes_only). Not under --executor compiled, whose
    start compiles every graph in the foreground, frozen ones (weights folded into the code) among them."""
    from ember.engine.startup.package_worker import in_worker

    return in_worker() and config.executor_config.executor != "compiled"


def int8_decode(config, setup: DeviceSetup, loaded: LoadedModel) -> int:
    """--int8-decode (auto: a dequantized GGUF in bf16/fp16 on CPU, whose copy buys back the decode
    speed of packed weights); returns the bytes added."""
    on, cpu = config.kernel_config.int8_decode, setup.device.type == "cpu"
    if on is None:
        on = loaded.format == "gguf" and loaded.quantization == "none" and cpu and setup.dtype != torch.float32
    if not on:
        return 0
    if loaded.quantization != "none":
        raise ConfigError(
            f"--int8-decode adds an int8 copy of dense weights; these are already {loaded.quantization} "
            "packed. Drop --int8-decode, or pass --quantization none"
        )
    if not cpu:
        raise ConfigError("--int8-decode is a CPU path; drop it on CUDA")
    if setup.dtype == torch.float32:
        raise ConfigError(
            "--int8-decode needs --dtype bfloat16 or float16 (torch's int8 kernel takes those activations)"
        )
    return enable_int8_decode(loaded.model)


def dense_copy(config, setup: DeviceSetup, loaded: LoadedModel, tensor_parallel: bool) -> int:
    """--int4-dense-copy (auto: on CPU in a bf16 / fp16 run where some packed layer has no kernel for many
    rows and the copy fits CPU_DENSE_COPY_FRACTION of free RAM, the LM head left packed); returns the
    bytes added. `need` counts the layers with a part whose kernel loses to a dense GEMM at many rows
    (weight_copies.packed_layers); on each build that is:
      AVX-512 BF16 + VNNI + VBMI (Zen4, Sapphire Rapids), bf16: none of a GGUF file's (every packed type,
        Q6_K included, runs the tiled GEMV's int8-x path from TILED_Q8_MIN_ROWS rows); an AWQ folder's
        (torch's int4 kernel) and, with --no-cpu-int8-activations, every packed layer: a copy;
      AVX-512 BF16 without VNNI / VBMI, bf16: the tiled GEMV serves INT4_KERNEL_MAX_ROWS rows: a copy;
      AVX2 + FMA + F16C (Zen2/3, Intel 12th-14th gen desktop), float32 (its --dtype auto): none (every
        GGUF type, Q6_K and the K-quants' two levels included, runs the int16-x tiled GEMV at every row
        count), so need == 0;
      bf16 / fp16 where the tiled GEMV does not take them (AVX2, --no-cpu-tiled-gemv): torch's int4
        kernel (Int4Part, Q6KPart, AWQ) at many rows: a copy.
    Never in float32: packed GGUF layers exist there only where the AVX2 build runs them at every row
    count (elsewhere the loader dequantizes), and AWQ in float32 runs torch's fp32 int4 kernel, whose
    decode is as slow with a copy as without (the copy, 8x the packed bytes, would serve prefill only)."""
    on, cpu = config.kernel_config.int4_dense_copy, setup.device.type == "cpu"
    if on is False:
        return 0
    head = on is True  # auto leaves the LM head packed (weight_copies.enable_dense_copy says why)
    need = dense_copy_bytes(loaded.model, setup.dtype, head)
    if on is None:
        on = (
            cpu
            and setup.dtype != torch.float32
            and not tensor_parallel
            and 0 < need <= CPU_DENSE_COPY_FRACTION * available_ram_bytes()
        )
        if not on:
            return 0
    if not cpu:
        raise ConfigError("--int4-dense-copy is a CPU path (CUDA runs AWQ through its own kernels); drop it")
    if need == 0:
        if packed_layers(loaded.model, helped=False):
            raise ConfigError(
                "--int4-dense-copy: every packed layer here runs its kernel at any batch size (the tiled "
                "GEMV's AVX2 build beats a float32 dense GEMM; its int8-activation path, "
                "--cpu-int8-activations, beats a bf16 one), so a copy would only cost memory. Drop the "
                "flag, or add --no-cpu-int8-activations for bf16 activations over a dense copy"
            )
        raise ConfigError(
            f"--int4-dense-copy needs packed int4 weights (a .gguf file or an AWQ folder); this model "
            f"is {loaded.quantization}. Drop the flag"
        )
    if tensor_parallel:
        raise ConfigError("--int4-dense-copy is not supported with --tensor-parallel-size > 1; drop one of them")
    return enable_dense_copy(loaded.model, setup.dtype, head)
