"""The first step of every engine start-up, rank 0's and each tensor-parallel worker's alike:
the device, the dtype, CPU threads and allocator, the seed, and which CPU kernels the model runs.

What it decides is one DeviceSetup, handed to everything built after it (the model and its
layers, the draft model, the KV pool), so no later step re-derives any of it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ember.config.attention import resolve_attention_backend
from ember.engine.startup.cpu_malloc import keep_freed_memory_in_heap
from ember.errors import ConfigError
from ember.kernels.cpu_kernels import CpuKernels
from ember.platform import has_cpu_flags, resolve_dtype_name, usable_cores

logger = logging.getLogger("ember")

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DeviceSetup:
    device: torch.device
    dtype: torch.dtype
    kernels: CpuKernels  # the C++ CPU kernels the model's layers may use (none on CUDA)
    attention_backend: str  # torch | cpu | triton: --attention-backend resolved for the device


def resolve_device(name: str) -> torch.device:
    """--device -> a torch device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """--dtype on this device (`auto`: ember.platform.resolve_dtype_name) as a torch dtype. float16 on a
    CPU computes as `auto` does there (bfloat16 with AVX512-BF16, else float32), with a warning: x86 CPUs
    have no float16 matmul (measured on the default model: 3 tok/s in float16 against 21 in bfloat16), and
    vLLM's CPU backend makes the same substitution, so its `--dtype half` launch lines stay usable."""
    if name == "float16" and device.type == "cpu" and not has_cpu_flags("avx512_fp16"):
        chosen = resolve_dtype_name("auto", "cpu")
        logger.warning("--dtype float16: this CPU has no float16 arithmetic; computing in %s instead", chosen)
        return TORCH_DTYPES[chosen]
    return TORCH_DTYPES[resolve_dtype_name(name, device.type)]


def init_device(
    config, world_size: int = 1, local_rank: int | None = None, device_type: str | None = None
) -> DeviceSetup:
    """Set this process up to run the model: threads and allocator on CPU (the cores are shared
    among world_size ranks), the seed; build or load the CPU kernels. A worker passes its
    local_rank (on CUDA its GPU, made the current device) and rank 0's device_type; rank 0 passes
    neither and runs on --device (the current GPU on CUDA)."""
    load, kc = config.load_config, config.kernel_config
    device = resolve_device(device_type or load.device)
    if device.type == "cuda" and local_rank is not None:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dtype = resolve_dtype(load.dtype, device)
    if device.type == "cpu":
        torch.set_num_threads(kc.num_threads or max(1, usable_cores() // world_size))
        keep_freed_memory_in_heap()
    kernels = CpuKernels.select(kc, device.type, dtype)
    torch.manual_seed(load.seed)
    return DeviceSetup(device, dtype, kernels, resolve_attention_backend(kc.attention_backend, device))
