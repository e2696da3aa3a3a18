"""An engine's limits, resolved once its device and model are known: max_model_len, max_num_seqs and
the step's token budget (their defaults and checks are SchedulerConfig's: config may not import the engine), the KV
cache dtype, and which executor runs its steps."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ember.config import EngineConfig
from ember.engine.executor.base import resolve_executor
from ember.engine.startup.device import DeviceSetup
from ember.errors import ConfigError
from ember.layers.attention import resolve_kv_cache_dtype
from ember.layers.gated_deltanet import GatedDeltaNet
from ember.loader.model_loader import LoadedModel
from ember.platform import resolve_kv_cache_dtype_name

logger = logging.getLogger("ember")


@dataclass
class Limits:
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int  # the step's token budget (SchedulerConfig.token_budget)
    kv_dtype: torch.dtype
    executor: str  # eager | compiled | cuda-graph
    background: bool = False  # compiled while serving (--executor auto on CPU), not before


def resolve_limits(config: EngineConfig, setup: DeviceSetup, loaded: LoadedModel) -> Limits:
    sched, model_max = config.scheduler_config, loaded.model_config.max_position_embeddings
    max_model_len = sched.max_model_len or model_max
    if max_model_len > model_max:
        raise ConfigError(
            f"--max-model-len {max_model_len} exceeds the model's context length "
            f"{model_max}; pass --max-model-len {model_max} or less"
        )
    max_num_seqs = sched.default_max_num_seqs(setup.device.type)
    budget = sched.token_budget(setup.device.type, max_model_len)
    if not sched.enable_chunked_prefill and budget < max_model_len:
        logger.info("chunked prefill is off: prompts longer than %d tokens will be refused", budget)
    kv_name = resolve_kv_cache_dtype_name(config.cache_config.kv_cache_dtype, config.dtype, setup.device.type)
    kv_dtype = resolve_kv_cache_dtype(kv_name, setup.dtype, setup.device)
    if loaded.model_config.indexer is not None and kv_dtype.itemsize == 1:
        raise ConfigError(
            f"--kv-cache-dtype {kv_name}: qwen4_exp's sparse attention does not read an fp8 KV cache yet; "
            "use --kv-cache-dtype auto or bfloat16"
        )
    blocker = hybrid_blocker(loaded, setup.device)
    executor = resolve_executor(config, setup.device, kv_dtype, loaded.model.attn_backend, blocker)
    background = executor == "compiled" and config.executor_config.executor == "auto"
    return Limits(max_model_len, max_num_seqs, budget, kv_dtype, executor, background)


def hybrid_blocker(loaded: LoadedModel, device: torch.device) -> str | None:
    """Why a hybrid model's decode steps cannot run in graphs (compiled or captured) on this device, or
    None (they can, or the model is not a hybrid). A graph calls the fused Gated DeltaNet kernels with
    the step's slot tensors (GatedDeltaNet._decode_graph), and holds no host sync (a MoE hybrid's experts
    run sync-free there: ember.layers.moe_compute)."""
    mc = loaded.model_config
    if not mc.is_hybrid:
        return None
    if mc.hc_count and device.type != "cpu":
        # CPU graphs call the PLE gather and the QSA top-k as ops that read the host (ember.layers.ple_gather,
        # ember.layers.qsa_graph); a captured CUDA graph cannot
        return "its PLE gather and QSA block selection have no capturable form yet (they read the host)"
    if any(device.type not in m.fused_ops for m in loaded.model.modules() if isinstance(m, GatedDeltaNet)):
        return (
            "its Gated DeltaNet layers run in torch ops here (--no-cpu-gated-delta-net, or the fused kernels "
            "are not built for this device), and a graph calls the fused kernels"
        )
    return None
