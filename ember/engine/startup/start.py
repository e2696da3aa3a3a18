"""Rank 0's engine start-up: everything LLMEngine drives, built once, in this order.

1. device.init_device            device, dtype, threads, allocator, seed, the CPU kernels
2. tp.group.start_tensor_parallel  (--tensor-parallel-size > 1) the workers, which run steps 1
                                  and 3 themselves (tp.worker.serve) with the same config
3. weights.load_weights          the model (rank 0's shard) and its second weight copies
4. limits.resolve_limits         max_model_len, max_num_seqs, the KV dtype, the executor kind
5. the Speculator                 first: a drafter with KV layers of its own needs its share of
                                  the pool, and it reads only a ProposerContext, not the engine
6. kv_pool.kv_pool               the blocks that fit the budget (refused when not one sequence does);
   hot_cache.size_hot_cache       then the device's hot-expert cache (--cpu-moe / --n-cpu-moe), from what the
                                  pool leaves
7. the block manager, the scheduler, the runner (mirrored to the workers under TP), the
   drafter's KV layers, the workers' caches
8. the executor                   compiled or captured graphs, after every KV layer exists; then
                                  the drafter's own graphs alike (--executor auto on CPU: compiled
                                  on a BackgroundCompiler while the engine serves eagerly)
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ember.engine import planner
from ember.engine.executor.base import build_executor, compiled_query_lens, graph_query_lens
from ember.engine.executor.compile_cache import graph_identity, use_compile_cache
from ember.engine.kv_cache import KVCacheManager
from ember.engine.runner import ModelRunner
from ember.engine.scheduler import Scheduler
from ember.engine.startup.device import DeviceSetup, init_device
from ember.engine.startup.hot_cache import size_hot_cache
from ember.engine.startup.kv_pool import cuda_kv_budget, kv_pool
from ember.engine.startup.limits import Limits, resolve_limits
from ember.engine.startup.package_worker import PackageWorkers, in_worker, worker_config, worker_peak_bytes
from ember.engine.startup.weights import WeightCopies, load_weights
from ember.engine.state_slots import StateSlots
from ember.loader.model_loader import LoadedModel
from ember.spec.proposer import KVSlots, ProposerContext
from ember.spec.speculator import Speculator

if TYPE_CHECKING:
    from ember.config import EngineConfig
    from ember.engine.executor.background_compile import BackgroundCompiler
    from ember.engine.tp.group import TensorParallelGroup

logger = logging.getLogger("ember")


@dataclass
class EngineParts:
    """What start-up built: LLMEngine keeps requests and the step loop over it. The engine holds it as
    engine.parts and copies nothing out of it, so each part has one name (engine.parts.runner,
    engine.parts.limits.max_model_len, engine.parts.loaded.tokenizer)."""

    config: EngineConfig
    setup: DeviceSetup
    tp: TensorParallelGroup | None  # None without TP
    loaded: LoadedModel
    copies: WeightCopies
    limits: Limits
    spec: Speculator | None
    compiler: BackgroundCompiler | None  # None: nothing compiles in the background
    kv: KVCacheManager
    scheduler: Scheduler
    runner: ModelRunner
    eos_token_ids: list[int]


def start_engine(config, defer_compile: bool = False) -> EngineParts:
    """Build an engine's parts from its validated EngineConfig (see the module docstring).
    defer_compile: a background compile waits for compiler.resume() (a server warms up first)."""
    # before anything of torch's compile machinery runs: torch fixes its cache folder at first use
    use_compile_cache()
    tp_size = config.parallel_config.tensor_parallel_size
    setup = init_device(config, world_size=tp_size)
    tp = None
    if tp_size > 1:  # the workers start (and load their shards) alongside rank 0's own load
        from ember.engine.tp.group import start_tensor_parallel

        tp = start_tensor_parallel(config, setup.device)
    with _sharding(tp):
        quantization = tp.quantization if tp is not None else config.load_config.quantization
        loaded, copies = load_weights(config, setup, quantization, tensor_parallel=tp is not None)
    limits = resolve_limits(config, setup, loaded)
    generators: dict[str, torch.Generator] = {}  # per-request seeded ones: the sampler's and a drafter's
    spec = None
    if config.speculative is not None:
        with _sharding(tp):
            spec = Speculator(config.speculative, _proposer_context(config, setup, tp, loaded, limits, generators))
    cache = config.cache_config
    states = _state_slots(config, setup, loaded, limits)
    pool = size_hot_cache(
        config, setup.device, loaded, _size_pool(config, setup, tp, loaded, limits, spec, states), limits
    )
    kv = KVCacheManager(pool.num_blocks, cache.block_size, cache.enable_prefix_caching, states)
    sched = config.scheduler_config
    scheduler = Scheduler(
        kv, limits.max_num_batched_tokens, limits.max_num_seqs, limits.max_model_len, sched.enable_chunked_prefill
    )
    runner = _build_runner(
        config,
        setup,
        tp,
        loaded,
        limits,
        pool.num_blocks,
        generators,
        spec,
        0 if states is None else states.num_live + states.num_snapshots,
    )
    compiler = _build_executors(config, tp, loaded, limits, runner, spec, pool, defer_compile)
    parts = EngineParts(
        config, setup, tp, loaded, copies, limits, spec, compiler, kv, scheduler, runner, _eos_token_ids(loaded)
    )
    _log_start(parts, pool)
    return parts


def _sharding(tp):
    """Inside: layers are built as rank 0's shard (a no-op without TP)."""
    if tp is None:
        return nullcontext()
    from ember.distributed.parallel_state import sharding

    return sharding(0, tp.world_size)


def _proposer_context(
    config, setup: DeviceSetup, tp, loaded: LoadedModel, limits: Limits, generators: dict
) -> ProposerContext:
    mirror = lambda module: module  # noqa: E731
    if tp is not None:  # an MTP layer's forwards are replayed on the workers' shards
        from ember.engine.tp.mirror import MirroredMTP

        mirror = MirroredMTP
    return ProposerContext(
        loaded,
        setup.device,
        setup.dtype,
        setup.kernels,
        setup.attention_backend,
        config.load_config.tokenizer,
        config.cache_config.block_size,
        limits.max_model_len,
        limits.max_num_seqs,
        generators,
        tensor_parallel=tp is not None,
        mirror=mirror,
    )


def _state_slots(config, setup: DeviceSetup, loaded: LoadedModel, limits: Limits) -> StateSlots | None:
    """A hybrid model's recurrent-state slots: one per sequence that may run, plus the snapshots."""
    if not loaded.model_config.is_hybrid:
        return None
    cache = config.cache_config
    return StateSlots(limits.max_num_seqs, cache.state_snapshots(limits.max_num_seqs), cache.block_size)


def _size_pool(
    config, setup: DeviceSetup, tp, loaded: LoadedModel, limits: Limits, spec, states: StateSlots | None = None
) -> planner.KVPool:
    mc, tp_size = loaded.model_config, config.parallel_config.tensor_parallel_size
    elem = limits.kv_dtype.itemsize
    per_token = planner.kv_bytes_per_token(mc, elem, tp_size)  # this device's kv heads
    if spec is not None:
        per_token += spec.kv_bytes_per_token(elem)
    block_bytes = per_token * config.cache_config.block_size

    def cuda_budget() -> float:
        on_workers = None
        if tp is not None:  # the workers run the same profile step (its collectives need them)
            from ember.distributed.comm import send_call as on_workers
        return cuda_kv_budget(
            loaded.model,
            min(limits.max_num_batched_tokens, limits.max_model_len),
            limits.max_num_seqs,
            planner.kv_heads_per_device(mc, tp_size),
            setup.dtype,
            setup.device,
            config.cache_config.gpu_memory_utilization,
            lambda: _graph_pool_bytes(config, setup, loaded, limits, spec),
            on_workers,
        )

    state_bytes = 0
    if states is not None:  # the recurrent states come out of the same budget, first
        per_seq = mc.state_bytes_per_seq(setup.dtype.itemsize, tp_size)
        state_bytes = per_seq * (states.num_live + states.num_snapshots)
        logger.info(
            "recurrent state: %.2f MB a sequence, %d slots (%d sequences + %d prefix-cache snapshots) = %.1f MB",
            per_seq / 1e6,
            states.num_live + states.num_snapshots,
            states.num_live,
            states.num_snapshots,
            state_bytes / 1e6,
        )
    return kv_pool(config, setup.device, block_bytes, limits.max_model_len, cuda_budget, state_bytes)


def _graph_pool_bytes(config, setup: DeviceSetup, loaded: LoadedModel, limits: Limits, spec) -> int:
    """The CUDA graphs' memory pool, which the KV cache cannot have (0 without CUDA graphs)."""
    if limits.executor != "cuda-graph":
        return 0
    from ember.engine.executor.cuda_graph import graph_pool_estimate

    q_len = max(graph_query_lens(spec.k_max if spec is not None else 0, loaded.model.attn_backend))
    return graph_pool_estimate(
        loaded.model,
        loaded.model_config,
        _graph_max_batch(config, limits),
        q_len,
        limits.max_model_len,
        config.cache_config.block_size,
        setup.dtype,
        setup.device,
    )


def _package_workers(config, runner, pool, limits) -> PackageWorkers:
    """The workers that build this engine's packages, with what one takes at its peak (checked on CPU,
    where the engine and its workers share the machine's memory)."""
    worker_cfg = worker_config(config, runner.device.type, pool, limits.max_model_len, limits.max_num_seqs)
    cpu = runner.device.type == "cpu"
    return PackageWorkers(worker_cfg, worker_peak_bytes(worker_cfg, runner.model) if cpu else 0)


def _graph_max_batch(config, limits: Limits) -> int:
    return min(config.executor_config.cuda_graph_max_batch_size, limits.max_num_seqs)


def _build_runner(
    config,
    setup: DeviceSetup,
    tp,
    loaded: LoadedModel,
    limits: Limits,
    num_blocks: int,
    generators: dict,
    spec,
    state_slots: int = 0,
) -> ModelRunner:
    """The runner over the pool; the drafter's layers in it; under TP the workers' caches alike."""
    model = loaded.model
    if tp is not None:  # every forward is replayed on the workers' shards
        from ember.engine.tp.mirror import MirroredModel

        model = MirroredModel(model)
    tp_size = config.parallel_config.tensor_parallel_size
    runner = ModelRunner(
        model,
        loaded.model_config,
        num_blocks,
        config.cache_config.block_size,
        limits.kv_dtype,
        setup.device,
        num_kv_heads=planner.kv_heads_per_device(loaded.model_config, tp_size),
        generators=generators,
        state_slots=state_slots,
    )
    if spec is not None:
        spec.attach(KVSlots(num_blocks, runner.allocate_kv))
        runner.keep_hidden = spec.reads_step == "hidden"
        runner.keep_rows = spec.reads_step == "rows"
    if tp is not None:
        tp.setup_workers(runner)
    return runner


def _build_executors(
    config,
    tp,
    loaded: LoadedModel,
    limits: Limits,
    runner: ModelRunner,
    spec,
    pool: planner.KVPool,
    defer_compile: bool = False,
):
    """After every KV layer exists (compiled graphs and captured graphs address the caches). Returns
    the BackgroundCompiler the executors compile on (None when they compiled here, or need none)."""
    k_max = spec.k_max if spec is not None else 0
    backend = loaded.model.attn_backend
    if limits.executor == "compiled":
        query_lens = compiled_query_lens(k_max, backend, spec is not None and spec.config.adaptive)
    else:
        query_lens = graph_query_lens(k_max, backend)
    if loaded.model_config.is_hybrid:  # a hybrid's verifies keep every token's state: eager (for now)
        query_lens = [1]
    compiler = None
    if limits.background:
        from ember.engine.executor.background_compile import BackgroundCompiler

        compiler = BackgroundCompiler(paused=defer_compile)
    runner.executor = build_executor(
        limits.executor,
        runner,
        max_model_len=limits.max_model_len,
        compile_options=config.executor_config.compile_options(limits.max_num_seqs),
        cuda_graph_max_batch=_graph_max_batch(config, limits),
        query_lens=query_lens,
        compiler=compiler,
        graph_identity=graph_identity(config, loaded.path),
        # packages are built by a worker process, so this one never holds a build (package_worker.py)
        package_workers=None if in_worker() else _package_workers(config, runner, pool, limits),
    )
    if spec is not None:  # the workers replay a drafter's forwards eagerly: no graphs of its own under TP
        spec.prepare(runner.executor, runner.executor.sibling if tp is None else lambda *args: None)
    return compiler


def _eos_token_ids(loaded: LoadedModel) -> list[int]:
    eos = list(loaded.tokenizer.eos_token_ids)
    mc_eos = loaded.model_config.eos_token_id
    eos += [mc_eos] if isinstance(mc_eos, int) else list(mc_eos) if isinstance(mc_eos, list) else []
    return list(dict.fromkeys(eos))


def _log_start(parts: EngineParts, pool: planner.KVPool) -> None:
    loaded, limits, setup = parts.loaded, parts.limits, parts.setup
    mc, bs = loaded.model_config, pool.block_size
    logger.info(
        "ember: %s, %.1fM parameters, %.1f MB weights%s, %s%s on %s, KV cache %s, %d blocks x %d = %d tokens (%.1f MB)%s, "
        "max_model_len %d, %s executor%s, loaded from %s in %.1fs",
        mc.architecture,
        loaded.num_parameters / 1e6,
        loaded.weight_bytes / 1e6,
        # the quantization the weights are held in ([fp8], [awq], ...), then what stays mapped cold
        (f" [{loaded.quantization}]" if loaded.quantization != "none" else "")
        + _mapped_note(loaded)
        + parts.copies.note(),
        str(setup.dtype).removeprefix("torch."),
        _dtype_note(parts),
        setup.device,
        str(limits.kv_dtype).removeprefix("torch."),
        pool.num_blocks,
        bs,
        pool.num_blocks * bs,
        pool.num_blocks * pool.block_bytes / 1e6,
        _state_note(parts),
        limits.max_model_len,
        limits.executor,
        _executor_note(parts),
        loaded.path,
        loaded.load_seconds,
    )


def _mapped_note(loaded: LoadedModel) -> str:
    """What of the model stays in the file's mapping, cold (resident only as steps touch it), beside the
    resident weights: experts kept in host memory (--cpu-moe / --n-cpu-moe), the n-gram table."""
    note = ""
    if loaded.mapped_expert_bytes:
        placement = loaded.placement
        layers = len(placement.host_layers)
        note += (
            f" (+ {loaded.mapped_expert_bytes / 1e6:.1f} MB of routed experts of {layers} MoE layer"
            f"{'s' if layers > 1 else ''} mapped cold from the file in host memory, read as steps choose them)"
        )
    if loaded.mapped_weight_bytes:
        note += f" (+ {loaded.mapped_weight_bytes / 1e6:.1f} MB read by row from the file's mapping)"
    return note


def _dtype_note(parts: EngineParts) -> str:
    """Why a CPU run computes in float32 when --dtype was left at auto, and what stays 16-bit anyway."""
    if parts.config.load_config.dtype != "auto" or parts.setup.device.type != "cpu":
        return ""
    if parts.setup.dtype != torch.float32:
        return ""
    kept = "; the weights stay as the file holds them" if parts.loaded.quantization in ("half", "gguf") else ""
    return f" (this CPU has no AVX512-BF16{kept})"


def _state_note(parts: EngineParts) -> str:
    """A hybrid's recurrent-state pool, beside the KV pool's line: what it holds and costs."""
    runner = parts.runner
    if not runner.recurrent_states:
        return ""
    slots, snapshots = runner.state_slots, parts.kv.states.num_snapshots if parts.kv.states is not None else 0
    nbytes = sum(st.nbytes for st in runner.recurrent_states)
    return (
        f", recurrent state {slots} slots ({slots - snapshots} sequences + {snapshots} prefix-cache snapshots) x "
        f"{nbytes / slots / 1e6:.2f} MB = {nbytes / 1e6:.1f} MB"
    )


def _executor_note(parts: EngineParts) -> str:
    if parts.compiler is None:
        return ""
    executor = parts.runner.executor
    loaded = sorted(executor.settled_sizes)
    rest = [size for size in executor.sizes if size not in executor.settled_sizes]
    now = (
        f"batch sizes {loaded} run compiled now, loaded from the compile cache"
        if loaded
        else "serving eagerly now, ember compile builds the graphs ahead"
    )
    return (
        (
            f" ({now}; decode steps at batch sizes {rest} switch to compiled graphs as the background compile "
            "finishes them, a larger size once as many requests run or the engine is idle: minutes on a cold "
            "compile cache, seconds on a warm one; --executor compiled compiles before serving, --executor eager "
            "never)"
        )
        if rest
        else f" ({now})"
    )
