"""The hot-expert cache's size (ember.layers.hot_experts), decided once the KV pool is: the device memory the
KV cache leaves (--cpu-moe / --n-cpu-moe keep a MoE model's experts in host memory; the cache keeps copies of
the most used ones on the device).

- --moe-hot-cache-memory GiB: that much. On CUDA it comes out of the KV budget (the pool loses the blocks,
  and is refused as ever when one sequence no longer fits); on CPU, where host memory is the device's,
  it is allocated beside the pool (the tests' way to exercise the cache logic with the CPU as the device).
- unset, on CUDA: the blocks the pool holds beyond max_num_seqs sequences of max_model_len (which the
  scheduler can never use at once), at most what every host expert needs; unset on CPU: no cache (the
  experts are in its memory already).
"""

from __future__ import annotations

import logging
import math

from ember.engine import planner
from ember.loader.model_loader import LoadedModel

logger = logging.getLogger("ember")
GiB = 1 << 30


def size_hot_cache(config, device, loaded: LoadedModel, pool: planner.KVPool, limits) -> planner.KVPool:
    """Size the loaded model's hot-expert cache (if it has one); returns the KV pool, smaller where the cache
    took blocks of it."""
    placement = loaded.placement
    cache = getattr(placement, "hot_cache", None)
    if cache is None:
        return pool
    wanted = placement.hot_cache_gib
    every = len(placement.host_layers) * loaded.model_config.num_experts * cache.expert_bytes
    blocks = 0
    if wanted is not None:
        nbytes = min(wanted * GiB, every)
        if device.type != "cpu" and pool.block_bytes:
            blocks = math.ceil(nbytes / pool.block_bytes)
    elif device.type != "cpu" and pool.block_bytes:
        need = limits.max_num_seqs * -(-limits.max_model_len // pool.block_size)
        blocks = max(0, min(pool.num_blocks - need, math.ceil(every / pool.block_bytes)))
        nbytes = blocks * pool.block_bytes
    else:
        nbytes = 0
    if blocks:
        pool = planner.KVPool(pool.budget_bytes, pool.block_size, pool.block_bytes, pool.num_blocks - blocks)
        planner.check_fits(pool, limits.max_model_len, "--moe-hot-cache-memory (lower it)")
    slots = cache.resize(nbytes)
    logger.info(
        "hot-expert cache: %d slots of %.2f MB (%.1f MB) on %s for the experts of %d MoE layers kept in host memory",
        slots,
        cache.expert_bytes / 1e6,
        cache.nbytes / 1e6,
        device,
        len(placement.host_layers),
    )
    return pool
