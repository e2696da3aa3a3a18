"""CompiledExecutor (CPU): inductor-compiled pure-decode forwards at a few batch sizes.

Why whole decode steps: on 2 CPU cores a third of an eager decode step is framework overhead;
inductor (mode max-autotune-no-cudagraphs; freezing for dense weights: auto_freezing)
removes most of it (docs/tuning.md, "Executor", has the figures).

Two ways to build a graph, one contract (`ready`: a callable per (size, q_len)):
- unfrozen (every quantized model, the default one included): an AOTInductor package per shape
  (ember.engine.executor.aot_package), exported once per machine and loaded by later processes in
  milliseconds, bound to the model's own tensors; it is called with no guards at all.
- frozen (dense weights folded into the graph, which a package would copy): torch.compile of `_forward`,
  persisted in torch's own caches (seconds a graph to load).
A shape whose package could not be built (its export or build failed, or a first start's worker had no
room: ember.engine.startup.package_worker) runs eagerly, with a log line that names `ember compile`:
torch.compile in the serving process was once its fallback, and it held the very build (GiBs, minutes of
the GIL) that package workers keep out of a serving engine.

Shapes: each compile size is one static graph, so a decode batch of B sequences is padded to the
next size (ember.engine.executor.decode_batch). The block-table width is the one dynamic dimension a step
changes (a sequence's length grows every step); the pool's block count is dynamic too, so any
--kv-cache-memory runs the same graphs. Speculative verifies (every sequence 1 + k queries) are
compiled too, at every size, where the attention backend runs them from fixed-shape metadata (the
torch backend with its fused C++ kernel: query_lens [1, 1 + k]). Not compiled (eager): prefill
chunks, mixed steps, verifies of another length (a pinned k cut short near max_tokens; with
adaptive k every 1 + k is compiled), steps with a RowSelection and batches above the largest size.
The MTP's fill and its layer-0 draft steps run in a CompiledExecutor of their own (row_inputs: the
hidden states; see MTPProposer.prepare).

Guards (torch.compile only): dynamo checks thousands of guards (every module attribute and parameter
the forward touched) before each call, a sizeable share of a batch-1 step (docs/tuning.md). The
executor already fixes every shape but the table width, so after warmup it calls dynamo's
transformed bytecode of `_forward` (captured with a bytecode hook, one per size) directly, with no
guard evaluation, as vLLM's custom dispatcher does. Each size's direct call is checked bit for bit
against the guarded one at warmup; a size that compiled to more than one graph, or fails the check,
keeps the guarded call. A package has no guards; its call was faster still (docs/tuning.md,
"Compile caches").

Foreground or background: built with a BackgroundCompiler (`--executor auto` on CPU), the
executor runs every step eagerly until the compile thread publishes a shape in `ready`
(ember.engine.executor.background_compile), except what this machine built before, loaded while the engine
is built (built_sizes); without one (`--executor compiled`) every shape is built in __init__. A
background torch.compile shape is published only with its direct call (never dynamo's guarded call,
which could recompile on the step thread) and only when the guards pass for the real pool.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import tempfile
import time
import types
from typing import Callable

import torch

from ember.engine.executor.decode_batch import (
    DecodeInputs,
    fixed_meta,
    graph_shape,
    pad_decode,
    table_width,
    take_decode_snapshots,
    warmup_inputs,
)
from ember.errors import EmberError
from ember.layers.moe_compute import calls_experts_op
from ember.layers.ple_gather import holds_process_keys
from ember.layers.rotary import RotaryEmbedding

logger = logging.getLogger("ember")


class CompileCancelled(Exception):
    """A background compile was cancelled (its engine is closing): the job ends here, quietly, without
    falling back to another way of compiling the shape."""


def _cache_entries() -> list:
    """dynamo's cache entries (one per graph, with .code and .guard_manager) for CompiledExecutor._forward
    so far in this process; [] if that private API moves (the guarded call still works)."""
    try:
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

        return list(_debug_get_cache_entry_list(CompiledExecutor._forward.__code__))
    except Exception:  # noqa: BLE001
        return []


def auto_freezing(model: torch.nn.Module) -> bool:
    """freezing's default: on when some linear keeps dense weights (inductor folds them in as constants
    and may repack them for its GEMMs), off when every linear is quantized (GGUF blocks, AWQ: ember's
    own kernels take the packed weights, so freezing has nothing to fold). Off also lets AOTAutograd's
    on-disk cache keep the traced graph, which it refuses for frozen ones: a restart then loads the
    default model's batch-1 graph in 7.5 s instead of 15.3 s, at the same decode speed (176-180 tok/s
    either way; docs/tuning.md, "Compile caches")."""
    from ember.layers.linear import DenseMethod, LinearBase

    return any(isinstance(m, LinearBase) and isinstance(m.quant_method, DenseMethod) for m in model.modules())


def step_forward(
    model: torch.nn.Module,
    block_size: int,
    input_ids,
    positions,
    slot_mapping,
    query_start_loc,
    seq_lens,
    block_tables,
    state_slots,
    state_sources,
    kv_caches,
    *rows,
) -> torch.Tensor:
    """One uniform-decode step of `model` over fixed-shape metadata: what every compiled graph traces."""
    x = DecodeInputs(
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, state_slots, state_sources
    )
    q_len = input_ids.shape[0] // block_tables.shape[0]  # static per graph
    return model(input_ids, positions, kv_caches, fixed_meta(x, q_len, block_size), None, *rows)


class DecodeStep(torch.nn.Module):
    """step_forward as a module, for torch.export (ember.engine.executor.aot_package); rows: a list (export
    takes no varargs). kv_caches arrives as package_tensors made it: a hybrid layer's RecurrentState as its
    pool tensors, which `layout` (cache_layout of the served layers' caches) turns back into a state over
    them; the model's graph pools (CompiledExecutor.pools) follow the layers' caches as they are."""

    def __init__(self, model: torch.nn.Module, block_size: int, layout: tuple):
        super().__init__()
        self.model, self.block_size, self.layout = model, block_size, layout

    def forward(
        self,
        input_ids,
        positions,
        slot_mapping,
        query_start_loc,
        seq_lens,
        block_tables,
        state_slots,
        state_sources,
        kv_caches,
        rows,
    ):
        return step_forward(
            self.model,
            self.block_size,
            input_ids,
            positions,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            state_slots,
            state_sources,
            _rebuilt_caches(kv_caches, self.layout),
            *rows,
        )


def cache_layout(caches: list) -> tuple:
    """Per layer cache of a step: None for a paged KV tensor, (its class, its conv kernel width) for a hybrid
    layer's RecurrentState (what DecodeStep needs to rebuild it from its tensors)."""
    return tuple(None if isinstance(c, torch.Tensor) else (type(c), c.conv_kernel) for c in caches)


def package_tensors(caches: list) -> list[torch.Tensor]:
    """A step's caches as the tensors a package takes: a paged KV cache (or a graph pool) as it is, a hybrid
    layer's RecurrentState as its pool tensors (RecurrentState.tensors(); export takes tensors only; the
    package writes the states in place, as the eager and dynamo steps do)."""
    return [t for c in caches for t in ((c,) if isinstance(c, torch.Tensor) else c.tensors())]


def _rebuilt_caches(tensors: list, layout: tuple) -> list:
    """package_tensors' inverse, inside the traced step: states over the handed tensors, then the graph
    pools as they are."""
    caches, it = [], iter(tensors)
    for entry in layout:
        if entry is None:
            caches.append(next(it))
        else:
            cls, kernel = entry
            caches.append(cls.over(tuple(next(it) for _ in cls.POOL_DIMS), kernel))
    return caches + list(it)


# How a ready shape's step runs: (inputs, per-row inputs, KV caches) -> the model's output
StepCall = Callable[[DecodeInputs, tuple, list], torch.Tensor]


def _inputs(x: DecodeInputs) -> tuple[torch.Tensor, ...]:
    """A step's tensors in _forward's (and a package's) argument order."""
    return (
        x.input_ids,
        x.positions,
        x.slot_mapping,
        x.query_start_loc,
        x.seq_lens,
        x.block_tables,
        x.state_slots,
        x.state_sources,
    )


def _kv_tensors(caches: list) -> list[torch.Tensor]:
    """The paged KV caches of a list of layer caches (a hybrid's also holds its layers' RecurrentStates)."""
    return [c for c in caches if isinstance(c, torch.Tensor)]


def graph_pools(model: torch.nn.Module, kv_caches: list) -> list[torch.Tensor]:
    """What a step of `model` writes beside its layers' caches, which a graph must be handed (model.graph_pools:
    qwen4_exp's indexer key pools), in the order the model takes them after the caches; [] for most models."""
    make = getattr(model, "graph_pools", None)
    return [] if make is None else list(make(kv_caches))


class CompiledExecutor:
    name = "compiled"

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        sizes: list[int],
        mode: str = "max-autotune-no-cudagraphs",
        freezing: bool = True,
        cpp_wrapper: bool = True,
        query_lens: list[int] = (1,),
        row_inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (),
        what: str = "compiled executor",
        compiler=None,
        graph_identity: str | None = None,
        package_workers=None,
    ):
        """row_inputs: (per-row shape, dtype) of tensors the model takes after (input_ids, positions,
        kv_caches, meta, select), one row per query (the MTP fill's hidden states). compiler: a
        BackgroundCompiler to compile on (None: compile now). graph_identity: what the graphs depend
        on (ember.engine.executor.compile_cache.graph_identity; None: no markers of built sizes).
        package_workers: builds packages in another process (ember.engine.startup.package_worker;
        None: built in this one)."""
        self.graph_identity = graph_identity
        self.package_workers = package_workers
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.device = next(iter(_kv_tensors(kv_caches)), next(model.parameters())).device
        self.recurrent_states = [c for c in kv_caches if not isinstance(c, torch.Tensor)]
        # a graph is handed the layers' caches, then the pools the model writes beside them (graph_pools)
        self.pools = graph_pools(model, kv_caches)
        self.graph_caches = [*kv_caches, *self.pools]
        self._pool_tensors = package_tensors(self.graph_caches)  # what every packaged step is handed: built once
        self.row_inputs, self.what = tuple(row_inputs), what
        self.max_model_len, self.mode, self.freezing, self.cpp_wrapper = max_model_len, mode, freezing, cpp_wrapper
        self.threads = torch.get_num_threads()  # the engine's, at start (see BackgroundCompiler.fit_step_threads)
        self.sizes = sorted(sizes)
        self.query_lens = sorted(query_lens)  # 1 (decode), and 1 + k (speculative verify)
        self.shapes = [(b, n) for n in self.query_lens for b in self.sizes]
        for m in model.modules():  # a grown cos/sin cache would be a new tensor: a recompile
            if isinstance(m, RotaryEmbedding):
                m.ensure_capacity(max_model_len)
        self._compiled = None  # torch.compile's wrapper of _forward, made by the first warmup (_make_compiled)
        self.compiles = 0  # graphs built at startup
        self.compiled_steps = 0  # steps that ran compiled (the rest ran eagerly)
        # Ahead of time (AOTInductor packages, ember.engine.executor.aot_package) unless freezing: a frozen graph
        # folds the weights in, and a package of it would carry a second copy of them. Frozen graphs go
        # through dynamo (torch.compile) instead; a shape whose package fails runs eagerly.
        # A hybrid's recurrent states are objects: a package takes their tensors (package_tensors).
        # A graph that calls ember::moe_experts holds keys to this process's modules (ember.layers.moe_compute),
        # which a package, loaded by later processes, must not.
        # A pool of one state slot would make export specialise the slot count: dynamo builds that one.
        # Likewise a PLE table held in memory (a key of this process: ember.layers.ple_gather).
        self.ahead_of_time = (
            not freezing
            and not calls_experts_op(model)
            and not holds_process_keys(model)
            and all(state.ssm.shape[0] >= 2 for state in self.recurrent_states)
        )
        self._direct: dict[tuple[int, int], types.FunctionType] = {}  # (size, q_len) -> compiled bytecode, no guards
        self._packages: dict[tuple[int, int], object] = {}  # (size, q_len) -> its loaded AOTInductor package
        # (size, q_len) -> how a step of that shape runs compiled (a package, dynamo's bytecode without its
        # guards, or dynamo's guarded call). A shape not in it runs eagerly. Filled by warmup (in the
        # background: size by size).
        self.ready: dict[tuple[int, int], StepCall] = {}
        self.call_seconds: dict[tuple[int, int], float] = {}  # (size, q_len) -> median seconds of a call, at warmup
        self.compiler = compiler
        self.cancelled = False  # set by cancel(): a background job stops at its next shape
        self.settled_sizes: set[int] = set()  # sizes whose shapes are compiled (or left eager) and timed
        if compiler is None:
            self.warmup()
        else:
            compiler.submit(self)

    def cancel(self) -> None:
        """Stop a background compile of this executor: a package worker it waits on ends now, and the job
        raises CompileCancelled at its next shape instead of compiling it some other way (at exit, a
        thread still compiling while the interpreter tears down ends the process in SIGABRT)."""
        self.cancelled = True
        if self.package_workers is not None:
            self.package_workers.cancel()

    def _check_cancelled(self) -> None:
        if self.cancelled:
            raise CompileCancelled(self.what)

    def built_marker(self, size: int) -> str | None:
        """The marker saying this machine has built the torch.compile graphs of `size` (None without an
        identity, and for packages: a package's own file says it was built)."""
        if self.graph_identity is None or self.ahead_of_time:
            return None
        from ember.engine.executor.compile_cache import built_marker

        options = {
            "mode": self.mode,
            "freezing": self.freezing,
            "cpp_wrapper": self.cpp_wrapper,
            "threads": self.threads,
        }
        return built_marker(self.graph_identity, self.what, size, [s for s in self.shapes if s[0] == size], options)

    def was_built(self, size: int) -> bool:
        if self.ahead_of_time and self.graph_identity is not None:
            return all(os.path.exists(self.package_path(s)) for s in self.shapes if s[0] == size)
        marker = self.built_marker(size)
        return marker is not None and os.path.exists(marker)

    def built_sizes(self) -> list[int]:
        """The sizes to load before the engine serves, from what this machine built before: every built
        size when they are packages (milliseconds each), else the smallest if built (seconds each)."""
        built = [size for size in self.sizes if self.was_built(size)]
        return built if self.ahead_of_time else [size for size in built if size == self.sizes[0]]

    def _inductor_options(self) -> dict:
        import torch._inductor

        # torch.compile takes a mode or options, not both: the mode's options plus ember's. Without
        # inductor's size/stride asserts: with the C++ wrapper each assert builds a std::stringstream,
        # ~1.5 us per custom-op call measured (5 such calls a layer); the ops' shapes are their fake
        # kernels', which the tests check. cpp.threads: loop splits for the engine's thread count,
        # whatever count the thread compiling has now.
        return dict(torch._inductor.list_mode_options(self.mode)) | {
            "cpp.threads": self.threads,
            "size_asserts": False,
            "alignment_asserts": False,
            "scalar_asserts": False,
        }

    def package_path(self, shape: tuple[int, int]) -> str:
        from ember.engine.executor.aot_package import package_path

        return package_path(
            self.graph_identity,
            self.what,
            shape,
            {"mode": self.mode, "threads": self.threads, "row_inputs": self.row_inputs},
        )

    @property
    def timed(self) -> bool:
        """Whether the smallest size's shapes are settled and timed (what verify_costs reads), or will
        never be (a background compile that ended without them)."""
        return self.sizes[0] in self.settled_sizes or (self.compiler is not None and self.compiler.done)

    def _forward(
        self,
        input_ids,
        positions,
        slot_mapping,
        query_start_loc,
        seq_lens,
        block_tables,
        state_slots,
        state_sources,
        kv_caches,
        *rows,
    ):
        return step_forward(
            self.model,
            self.block_size,
            input_ids,
            positions,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            state_slots,
            state_sources,
            kv_caches,
            *rows,
        )

    @property
    def direct_shapes(self) -> list[tuple[int, int]]:
        """(size, q_len) called straight, with no guard evaluation (a package, or dynamo's bytecode)."""
        return sorted(set(self._direct) | set(self._packages))

    @property
    def package_shapes(self) -> list[tuple[int, int]]:
        """(size, q_len) that run an AOTInductor package."""
        return sorted(self._packages)

    def _call(self, x: DecodeInputs, rows: tuple = (), caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        # The table width grows with the longest sequence; everything else is static per size. The
        # pool's block count is symbolic too: engines with another --kv-cache-memory (or an MTP layer
        # in the pool) reuse the same graphs from inductor's cache instead of compiling their own.
        caches = self.graph_caches if caches is None else caches
        torch._dynamo.maybe_mark_dynamic(x.block_tables, 1)
        layers = len(self.kv_caches)
        for cache in _kv_tensors(caches[:layers]):
            torch._dynamo.maybe_mark_dynamic(cache, 1)
        for pool in caches[layers:]:  # per pool block's slot, like the caches' blocks
            torch._dynamo.maybe_mark_dynamic(pool, 0)
        return self._compiled(*_inputs(x), caches, *rows)

    def _eager_call(self, x: DecodeInputs, rows: tuple = (), caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        return self._forward(*_inputs(x), self.graph_caches if caches is None else caches, *rows)

    def _call_direct(
        self, fn: types.FunctionType, x: DecodeInputs, rows: tuple = (), caches: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        return fn(self, *_inputs(x), self.graph_caches if caches is None else caches, *rows)

    def _call_package(
        self, package, x: DecodeInputs, rows: tuple = (), caches: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        pool = caches is None or caches is self.graph_caches
        return package([*_inputs(x), *(self._pool_tensors if pool else package_tensors(caches)), *rows])

    def _scratch_caches(self) -> list[torch.Tensor]:
        """Caches of the pool's very shape, for a background compile to write instead of the pool the
        engine serves from. Uninitialised but for block 0, the one a warmup step touches: only its
        pages are ever written, so they cost no memory to speak of. The same block count as the pool, not a few blocks: inductor
        sizes its loops from the hint of every dynamic dimension, and graphs compiled on a 4-block
        hint ran batch-1 decode 0.87x [0.81-0.89] as fast (benchmarks/default-executor.md at 3147fd6)."""
        with torch.inference_mode(False):  # normal tensors, as the pool's are: dynamo guards on the difference
            # a hybrid's recurrent states are the pool's own: a warmup step reads and writes no state slot
            caches = [torch.empty_like(c) if isinstance(c, torch.Tensor) else c for c in self.kv_caches]
            for cache in _kv_tensors(caches):
                # block 0 is what a warmup step reads: a q_len > 1 step attends to slots only row 0 wrote,
                # and leftover NaNs there would fail the check that the direct call equals the guarded one
                cache[:, 0].zero_()
            pools = [torch.empty_like(p) for p in self.pools]  # written at block 0's slots, as the caches
            for pool in pools:
                pool[: self.block_size].zero_()
            return caches + pools

    def _dummy_rows(self, n: int, dev) -> tuple:
        return tuple(torch.zeros(n, *shape, dtype=dtype, device=dev) for shape, dtype in self.row_inputs)

    def _make_compiled(self) -> None:
        """torch.compile of _forward, at the first warmup: importing dynamo and inductor costs ~3 s,
        which a background compile keeps off the engine's start."""
        if self._compiled is not None:
            return
        import torch._dynamo

        # cpp_wrapper_build_separate: the C++ entry function (one call per op, ~300 for the default model)
        # is built at -O1 apart from the kernels. One -O3 build of both took 71 of a cold compile's 104 s;
        # apart, the compile took 45 s, at the same decode speed (docs/tuning.md, "Compile caches").
        options = self._inductor_options() | {
            "freezing": self.freezing,
            "cpp_wrapper": self.cpp_wrapper,
            "cpp_wrapper_build_separate": True,
        }
        self._compiled = torch.compile(self._forward, options=options, dynamic=False, fullgraph=True)

    @torch.inference_mode()
    def warmup(self, background: bool = False, sizes: list[int] | None = None) -> None:
        """Compile (or load) every (size, q_len) of `sizes` (default: all): in the foreground with a dummy
        step writing block 0 of the pool (zeroed again after), in the background with scratch caches,
        publishing each shape as it is checked (BackgroundCompiler runs one size at a time, smallest
        first across executors: batch 1 runs compiled soonest)."""
        from ember.engine.executor.compile_cache import mark_built, use_compile_cache

        self.cache_dir = use_compile_cache()
        sizes = set(self.sizes if sizes is None else sizes)
        dev = self.device
        caches = self._scratch_caches() if background else self.graph_caches
        total = time.perf_counter()
        shapes = sorted(s for s in self.shapes if s[0] in sizes)
        if self.ahead_of_time:
            elsewhere = self._build_in_worker(shapes)
            for shape in shapes:  # a shape left without its package runs eagerly (the module docstring)
                self._check_cancelled()
                self._warmup_package(shape, caches, shape not in elsewhere)
        else:
            self._check_cancelled()
            self._warmup_dynamo(shapes, caches, background)
        self._time_calls(dev, caches, sizes)
        # settled only once timed: the engine's thread reads `timed` and then verify_costs (a race
        # that priced adaptive k from no timings at all when settled came first)
        self.settled_sizes |= sizes
        for size in sizes:
            marker = self.built_marker(size)
            if marker is not None and all(s in self.ready for s in self.shapes if s[0] == size):
                mark_built(marker)
        if not background:
            for cache in _kv_tensors(self.kv_caches):
                cache[:, 0].zero_()
            for pool in self.pools:
                pool[: self.block_size].zero_()
        logger.info(
            "%s: sizes %s x query lengths %s %s in %.1fs (compile cache: %s)",
            self.what,
            sorted(sizes),
            self.query_lens,
            "compiled in the background; decode steps of those shapes now run compiled" if background else "ready",
            time.perf_counter() - total,
            self.cache_dir,
        )

    def _build_in_worker(self, shapes: list[tuple[int, int]]) -> set[tuple[int, int]]:
        """The shapes of `shapes` whose packages are a worker process's to build (built or not, or no worker
        could start): those this machine lacks, when this executor has package workers and a graph
        identity (the key a worker's package is found by). A serving process never builds one itself."""
        if self.package_workers is None or self.graph_identity is None:
            return set()
        missing = [s for s in shapes if not os.path.exists(self.package_path(s))]
        if missing:
            t0 = time.perf_counter()
            try:
                ok = self.package_workers.build(self.what, missing)
            except Exception as e:  # noqa: BLE001 - no worker could start (its config, no process): eager
                logger.warning(
                    "%s: no package worker could start (%s: %s); those shapes run eagerly",
                    self.what,
                    type(e).__name__,
                    e,
                )
                return set(missing)
            self._check_cancelled()  # the worker was ended for a closing engine: nothing to report
            logger.info(
                "%s: a worker process %s the packages of %s in %.1fs",
                self.what,
                "built" if ok else "failed to build",
                missing,
                time.perf_counter() - t0,
            )
        return set(missing)

    def _warmup_package(self, shape: tuple[int, int], caches: list[torch.Tensor], build: bool = True) -> bool:
        """Make `shape` ready from its AOTInductor package: loaded if this machine built it before, else
        exported and compiled now (and kept for later processes) when `build`. False when that fails
        (the shape runs eagerly); a package that fails to load is deleted and built again (here, when
        `build`)."""
        from ember.engine.executor import aot_package

        b, n = shape
        t0 = time.perf_counter()
        x = warmup_inputs(b, n, table_width(n, self.block_size), self.device)
        rows = self._dummy_rows(b * n, x.input_ids.device)
        keep = self.graph_identity is not None  # without an identity there is no key: built for this process only
        path = self.package_path(shape) if keep else os.path.join(tempfile.mkdtemp(prefix="ember-aot-"), "step.pt2")
        package = None
        try:
            package = aot_package.load(path, self.model)
        except Exception as e:  # noqa: BLE001 - a stale or broken package is built again
            logger.warning(
                "%s: the package of batch %d x %d did not load (%s: %s); building it again",
                self.what,
                b,
                n,
                type(e).__name__,
                e,
            )
            aot_package.discard(path)
        how = "loaded from its ahead-of-time package"
        try:
            if package is None and not build:
                raise EmberError("its worker process left no package (see the worker's log above)")
            if package is None:
                how = "compiled ahead of time"
                layout = cache_layout(caches[: len(self.kv_caches)])
                dynamic = self._dynamic_shapes(layout, len(self.pools), len(rows))
                aot_package.build(
                    DecodeStep(self.model, self.block_size, layout),
                    self.model,
                    (*_inputs(x), package_tensors(caches), list(rows)),
                    dynamic,
                    self._inductor_options(),
                    path,
                )
                package = aot_package.load(path, self.model)
            out = self._call_package(package, x, rows, caches)  # fails here, not on a request
            if out.shape[0] != b * n:
                raise EmberError(f"the package returned {out.shape[0]} rows for {b * n} queries")
        except Exception as e:  # noqa: BLE001 - the shape runs eagerly
            aot_package.discard(path)
            self._check_cancelled()  # its compilers were ended for a closing engine: no warning
            logger.warning(
                "%s: batch %d x %d could not run as an ahead-of-time package (%s: %s); its steps run eagerly "
                "(`ember compile` with this engine's flags builds it in the foreground)",
                self.what,
                b,
                n,
                type(e).__name__,
                e,
            )
            return False
        finally:
            if not keep:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        self._packages[shape] = package
        self.ready[shape] = functools.partial(self._call_package, package)
        self.compiles += 1
        logger.info("%s: batch %d x %d queries %s in %.1fs", self.what, b, n, how, time.perf_counter() - t0)
        return True

    @torch.inference_mode()
    def build_package(self, shape: tuple[int, int]) -> None:
        """Build `shape`'s package into the compile cache now, against scratch caches (`ember compile`
        and its workers, before the compile that loads them)."""
        if not self._warmup_package(shape, self._scratch_caches()):
            raise EmberError(f"{self.what}: batch {shape[0]} x {shape[1]} did not build as a package (see the log)")

    @staticmethod
    def _dynamic_shapes(layout: tuple, num_pools: int, num_rows: int) -> tuple:
        """What export keeps symbolic: the block-table width (it grows with the longest sequence) and the
        pool's block count (so that any --kv-cache-memory runs the same package; a graph pool's rows, one a
        block's slot, likewise), and for a hybrid the state pool's slot count (layout: cache_layout; any
        --max-num-seqs and --max-state-snapshots; RecurrentState.POOL_DIMS says which dimension counts them)."""
        width, blocks = torch.export.Dim("table_width", min=2), torch.export.Dim("pool_blocks", min=2)
        dims = {"slots": torch.export.Dim("state_slots", min=2), "slots+1": torch.export.Dim("state_rows", min=3)}
        caches = []
        for entry in layout:
            caches += [{1: blocks}] if entry is None else [{0: dims[name]} for name in entry[0].POOL_DIMS]
        caches += [{0: torch.export.Dim("pool_slots", min=2)}] * num_pools
        return (None,) * 5 + ({1: width}, None, None, caches, [None] * num_rows)

    def _warmup_dynamo(self, shapes: list[tuple[int, int]], caches: list[torch.Tensor], background: bool) -> None:
        """Compile `shapes` with torch.compile, each run straight through dynamo's bytecode where that
        equals the guarded call (and, in the background, the real pool passes the guards)."""
        self._make_compiled()
        # One graph per shape, plus slack for a re-specialisation; dynamo's default limit is 8. Every
        # executor in this process (other engines, the MTP fill) adds entries to the same code object.
        # Set on every warmup: dynamo's config is the calling thread's, and each background job runs
        # on a thread of its own (ember.engine.executor.background_compile).
        torch._dynamo.config.recompile_limit = max(
            torch._dynamo.config.recompile_limit, len(_cache_entries()) + 2 * len(self.shapes) + 4
        )
        dev = self.device
        source = CompiledExecutor._forward
        codes: list[types.CodeType] = []  # dynamo's rewritten bytecode of _forward, one per graph
        hook = torch._dynamo.convert_frame.register_bytecode_hook(
            lambda old, new: codes.append(new) if old is source.__code__ else None
        )
        try:
            for b, n in shapes:
                self._check_cancelled()
                t0 = time.perf_counter()
                seen = len(codes)
                x = warmup_inputs(b, n, table_width(n, self.block_size), dev)
                rows = self._dummy_rows(b * n, dev)
                guarded = self._call(x, rows, caches)
                self.compiles += 1
                logger.info("%s: batch %d x %d queries compiled in %.1fs", self.what, b, n, time.perf_counter() - t0)
                # a new graph's bytecode, or that of the cached graph dynamo chose (an earlier engine's
                # in this process, e.g. another --kv-cache-memory: weights are graph inputs, so it fits)
                code = (
                    codes[-1]
                    if len(codes) == seen + 1
                    else self._reused_code(x, rows, caches)
                    if len(codes) == seen
                    else None
                )
                if code is not None:
                    fn = types.FunctionType(
                        code, source.__globals__, source.__name__, source.__defaults__, source.__closure__
                    )
                    # same step again: same slot, same values; and the graph must not have specialised the
                    # table width (a direct call skips the guard that would catch it: a wider table would run
                    # the graph of this one)
                    if torch.equal(self._call_direct(fn, x, rows, caches), guarded) and self._any_width(
                        code, x, caches
                    ):
                        self._direct[(b, n)] = fn
                direct = functools.partial(self._call_direct, self._direct[(b, n)]) if (b, n) in self._direct else None
                if not background:
                    self.ready[(b, n)] = direct or self._call
                    if direct is None:
                        logger.warning(
                            "%s: batch %d x %d keeps dynamo's guarded call (~2 ms a step slower)", self.what, b, n
                        )
                elif direct is not None and self._reused_code(x, rows) is code:  # the real pool passes its guards
                    self.ready[(b, n)] = direct
                else:
                    logger.warning(
                        "%s: batch %d x %d compiled but cannot run on the pool without dynamo's guards; "
                        "its steps stay eager",
                        self.what,
                        b,
                        n,
                    )
        finally:
            hook.remove()

    def _any_width(self, code: types.CodeType, x: DecodeInputs, caches: list) -> bool:
        """Whether the graph of `code` (compiled on x) also takes a wider block table (its guards pass for one)."""
        b, w = x.block_tables.shape
        wider = warmup_inputs(b, x.input_ids.shape[0] // b, w + 1, x.block_tables.device)
        if self._reused_code(wider, self._dummy_rows(x.input_ids.shape[0], x.input_ids.device), caches) is code:
            return True
        logger.warning(
            "%s: a graph of batch %d specialised the block-table width; it keeps dynamo's guards", self.what, b
        )
        return False

    def _reused_code(
        self, x: DecodeInputs, rows: tuple, caches: list[torch.Tensor] | None = None
    ) -> types.CodeType | None:
        """The rewritten bytecode of the cache entry of `_forward` whose guards pass for these arguments
        (default caches: the pool's; None if there is none, or dynamo's private API moved)."""
        values = (self, *_inputs(x), self.graph_caches if caches is None else caches, rows)
        frame = dict(zip(CompiledExecutor._forward.__code__.co_varnames[: len(values)], values))
        try:
            return next((e.code for e in _cache_entries() if e.guard_manager.check(frame)), None)
        except Exception:  # noqa: BLE001 - the guarded call still works
            return None

    def _time_calls(self, dev, caches: list[torch.Tensor], sizes: set[int], rounds: int = 5) -> None:
        """Median seconds of one call per shape of `sizes` (merged into call_seconds), the shapes interleaved round by round so that a burst
        of other work on the machine hits them alike. Speculation prices a verify row from these."""
        inputs = {
            s: (warmup_inputs(s[0], s[1], table_width(s[1], self.block_size), dev), self._dummy_rows(s[0] * s[1], dev))
            for s in self.shapes
            if s[0] in sizes
        }
        times: dict[tuple[int, int], list[float]] = {s: [] for s in inputs}
        for _ in range(rounds):
            for s, (x, rows) in inputs.items():
                # a shape without a direct call: dynamo's guarded one, or, with no package, the eager forward
                call = self.ready.get(s, self._eager_call if self.ahead_of_time else self._call)
                t0 = time.perf_counter()
                call(x, rows, caches)
                times[s].append(time.perf_counter() - t0)
        self.call_seconds |= {s: sorted(t)[len(t) // 2] for s, t in times.items()}

    def verify_costs(self, size: int | None = None) -> dict[int, float]:
        """k -> what a step of 1 + k queries per sequence at `size` (default: the smallest) adds over a
        1-query step, as a share of it, for every compiled query length (empty when none is longer)."""
        size = self.sizes[0] if size is None else size
        base = self.call_seconds.get((size, 1))
        if not base:
            return {}
        return {
            n - 1: max(0.0, (self.call_seconds[(size, n)] - base) / base)
            for n in self.query_lens
            if n > 1 and (size, n) in self.call_seconds
        }

    def extra_query_cost(self, size: int | None = None) -> float | None:
        """What one more query per sequence adds to a compiled step at `size` (default: the smallest),
        as a share of a 1-query step (graph time only, so a little above its share of a whole engine
        step); None when no longer query length is compiled."""
        costs = self.verify_costs(size)
        if not costs:
            return None
        k = max(costs)  # the longest: the per-query slope, least swayed by timer noise
        return costs[k] / k

    def sibling(self, model, kv_caches, row_inputs=(), what: str = "compiled executor") -> "CompiledExecutor":
        """The same sizes, query lengths and inductor options for another module (the MTP fill)."""
        return type(self)(
            model,
            kv_caches,
            self.block_size,
            self.max_model_len,
            self.sizes,
            self.mode,
            self.freezing,
            self.cpp_wrapper,
            self.query_lens,
            row_inputs=row_inputs,
            what=what,
            compiler=self.compiler,
            graph_identity=self.graph_identity,
            package_workers=self.package_workers,
        )

    def covers(self, meta) -> bool:
        """Whether a step of this metadata (and no RowSelection) runs compiled."""
        return graph_shape(meta, self.sizes, self.query_lens) in self.ready

    def run(self, input_ids, positions, meta, select=None, *rows):
        """rows: the model's per-row inputs (row_inputs), [T, ...] each."""
        shape = None if select is not None else graph_shape(meta, self.sizes, self.query_lens)
        if shape not in self.ready:  # not a compiled shape, or not compiled yet (background)
            return self.model(input_ids, positions, self.kv_caches, meta, select, *rows)
        batch, n = shape
        x = pad_decode(input_ids, positions, meta, batch, table_width(meta.max_seq_len, self.block_size))
        T = x.input_ids.shape[0]
        if rows and T > input_ids.shape[0]:  # padded sequences: zero rows (their slots are -1, their outputs dropped)
            rows = tuple(torch.nn.functional.pad(r, (0, 0) * (r.dim() - 1) + (0, T - r.shape[0])) for r in rows)
        self.compiled_steps += 1
        out = self.ready[shape](x, rows, self.graph_caches)
        take_decode_snapshots(meta, self.recurrent_states)
        return out[: input_ids.shape[0]]
