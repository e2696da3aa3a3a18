"""The KV pool's size: how many blocks the memory budget holds (ember.engine.planner's arithmetic).

CPU: --kv-cache-memory GiB, or CPU_KV_FRACTION of available RAM capped at CPU_KV_CAP_GIB (the
pool is allocated up front). CUDA: one forward at the full token budget measures the activation
peak (the tensor-parallel workers run it too: its collectives need them), the CUDA graphs' pool
is estimated, and the KV cache gets what --gpu-memory-utilization leaves.
"""

from __future__ import annotations

from typing import Callable

import torch

from ember.config import CPU_KV_CAP_GIB, CPU_KV_FRACTION
from ember.engine import planner
from ember.kernels.metadata import AttentionMetadata
from ember.platform import available_ram_bytes

GiB = 1 << 30


def kv_pool(
    config,
    device: torch.device,
    block_bytes: int,
    max_model_len: int,
    cuda_budget: Callable[[], float],
    state_bytes: int = 0,
) -> planner.KVPool:
    """The pool for blocks of block_bytes, refused (KVCacheTooSmallError, naming the flag) when not
    one sequence of max_model_len fits. cuda_budget: measures the budget on CUDA; state_bytes: a
    hybrid model's recurrent-state slots, taken from the budget first."""
    cache = config.cache_config
    if device.type == "cpu":
        budget = (
            cache.kv_cache_memory * GiB
            if cache.kv_cache_memory is not None
            else min(CPU_KV_FRACTION * available_ram_bytes(), CPU_KV_CAP_GIB * GiB)
        )
    else:
        budget = cuda_budget()
    knob = "--kv-cache-memory" if device.type == "cpu" else "--gpu-memory-utilization"
    planner.check_states_fit(budget, state_bytes, knob)
    pool = planner.kv_pool(budget - state_bytes, block_bytes, cache.block_size)
    planner.check_fits(pool, max_model_len, knob)
    return pool


def cuda_kv_budget(
    model: torch.nn.Module,
    num_tokens: int,
    num_seqs: int,
    kv_heads: int,
    dtype: torch.dtype,
    device: torch.device,
    utilization: float,
    reserved: Callable[[], int],
    on_workers: Callable[..., None] | None = None,
) -> float:
    """Bytes left for the KV cache after one forward of num_tokens (no KV kept) and `reserved()`
    (the CUDA graphs' pool): total x utilization - other processes' use - the peak - reserved.
    on_workers: sends the same profile step to the tensor-parallel workers first."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    if on_workers is not None:
        on_workers("profile", num_tokens, num_seqs, kv_heads, dtype)
    profile_forward(model, num_tokens, num_seqs, kv_heads, dtype, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_allocated(device)
    return max(0.0, total * utilization - used_by_others - peak - reserved())


def profile_forward(model, n: int, num_seqs: int, kv_heads: int, dtype: torch.dtype, dev: torch.device) -> None:
    """One forward of n tokens (no KV kept) and the logits of num_seqs rows: the activation peak."""
    mc = model.cfg
    caches = [torch.empty(2, 1, n, kv_heads, mc.head_dim, dtype=dtype, device=dev) for _ in range(mc.num_layers)]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=dev),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=dev),
        block_size=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
        max_query_len=n,
        max_seq_len=n,
    )
    with torch.inference_mode():
        hidden = model(torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), caches, meta)
        model.compute_logits(hidden[-num_seqs:])
