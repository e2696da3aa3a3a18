"""A package worker's engine (ember.engine.startup.package_worker.worker_config): its parent's configuration
with a KV pool of what a build touches, so that the worker does not hold a second serving pool beside its
copy of the weights; its graphs' identity (and so its packages' paths) stays the parent's."""

from __future__ import annotations

from ember.config import EngineConfig
from ember.engine.executor.compile_cache import graph_identity
from ember.engine.planner import GiB, KVPool, cpu_kv_budget_bytes
from ember.engine.startup.package_worker import worker_config


def test_worker_pool_holds_one_long_sequence_and_keeps_the_graph_identity(tmp_path):
    parent = EngineConfig(model=str(tmp_path), kv_cache_memory=2.0, max_model_len=4096, max_num_seqs=4)
    states = 0.25 * GiB  # 4 live slots and the default 8 snapshots
    pool = KVPool(budget_bytes=2.0 * GiB - states, block_size=16, block_bytes=98304, num_blocks=16384)
    worker = worker_config(parent, "cpu", pool, max_model_len=4096, max_num_seqs=4)
    blocks = 4096 // 16 + 4 + 1
    # the live slots' states, then its blocks; no snapshots
    assert cpu_kv_budget_bytes(worker) == states * 4 / 12 + blocks * pool.block_bytes
    assert worker.max_state_snapshots == 0
    assert graph_identity(worker, str(tmp_path)) == graph_identity(parent, str(tmp_path))
    assert worker.max_model_len == parent.max_model_len and worker.max_num_seqs == parent.max_num_seqs


def test_a_pool_already_as_small_and_cuda_keep_the_parents_configuration(tmp_path):
    parent = EngineConfig(model=str(tmp_path), kv_cache_memory=0.01)
    pool = KVPool(budget_bytes=0.005 * GiB, block_size=16, block_bytes=1 << 20, num_blocks=5)
    assert worker_config(parent, "cpu", pool, max_model_len=4096, max_num_seqs=4) is parent
    assert worker_config(parent, "cuda", pool, max_model_len=16, max_num_seqs=1) is parent
