"""BackgroundCompiler: compiled CPU graphs built on a thread while the engine serves eagerly.

`--executor auto` on CPU is the compiled executor, built this way: the engine answers at once
(eager steps, or graphs this machine built before, loaded first), daemon threads compile each
CompiledExecutor's shapes in turn, one thread a batch size (the model's decode steps, then the MTP
fill's), and a shape starts running compiled at the first step after its graph is ready and
checked. A cold compile costs ~40-47 s per shape of the default model on 2 cores (a later start
loads its packages in milliseconds); `--executor compiled` compiles in the foreground instead,
before the engine takes a request.

The thread never touches the engine's KV pool: it compiles against scratch caches of the pool's
shape (the pool's block count is a dynamic dimension of every graph), and a torch.compile shape is
published only when dynamo's guards pass for the real pool. It runs at serving's own CPU priority: at nice 10,
as it first did, a busy server left its compilers about 5% of a core (CFS weights 110 against
1024 a thread), and a first compile of the default model had not finished after 240 s of
continuous requests (issue 38). At equal priority it takes a core while it runs, and the engine's
steps take one intra-op thread meanwhile (fit_step_threads), for the minutes of a first compile
only (a restart loads what was built: ember.engine.executor.compile_cache); the GIL still
slows eager steps while it traces. When the engine's process ends (exit, Ctrl-C, SIGTERM),
compilers it started are ended with it (close); for a SIGKILLed one, a compile guard process
(ember.engine.executor.compile_guard, alive only while a compile runs) ends them.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import queue
import subprocess
import sys
import threading
import time

import torch

from ember.engine.executor.compiled import CompileCancelled

logger = logging.getLogger("ember")

IDLE_BEFORE_LARGER_SIZES_S = 5.0  # how long the engine is idle before a larger batch size compiles unasked
# how long close() waits for a running job to notice it was cancelled (its compilers and package worker are
# ended at once; what is left is Python between two checks: a trace, a package load)
CLOSE_JOIN_S = 60.0


class BackgroundCompiler:
    def __init__(self, paused: bool = False, demand=None):
        """paused: jobs wait for resume() (a server warms up first, then compiles). demand: how many
        requests run now (the engine's; None: none ever do), which the larger batch sizes wait on."""
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()  # (batch size, order, executor)
        self._order = itertools.count()
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        self._guard: subprocess.Popen | None = None
        self.failures: list[str] = []
        self.executors: list = []  # every CompiledExecutor submitted (the model's, the MTP fill's)
        self.demand = demand  # None: nothing is served beside the compile (ember compile), no size waits
        self._active = threading.Event()  # a job is compiling now (the engine's steps then take one thread)
        # built on the thread that will step the engine, after its thread count is set
        self.step_threads = self._step_threads_now = torch.get_num_threads()
        self._go = threading.Event()
        if not paused:
            self._go.set()
        atexit.register(self.close)

    def submit(self, executor) -> None:
        """Queue executor.warmup(background=True, sizes=[b]) for each of its batch sizes b. Jobs run one
        at a time, smallest size first across executors (the model's batch-1 graphs, then the MTP
        fill's, then batch 2, ...), in submission order within a size. What this machine built before
        (executor.built_sizes) is loaded here, before the engine serves: milliseconds a graph from an
        AOTInductor package, or seconds from torch's caches for the smallest size of a frozen (dense)
        model, where loading it beside eager steps slowed both several-fold."""
        built = executor.built_sizes()
        if built:
            t0 = time.perf_counter()
            try:
                executor.warmup(background=True, sizes=built)
                logger.info(
                    "%s: batch sizes %s loaded from the compile cache before serving in %.1fs",
                    executor.what,
                    built,
                    time.perf_counter() - t0,
                )
            except Exception as e:  # noqa: BLE001 - a failed load leaves those steps eager, never the engine down
                self.failures.append(f"{executor.what} batch sizes {built}: {type(e).__name__}: {e}")
                logger.warning(
                    "%s: loading batch sizes %s failed (%s: %s); their steps run eagerly",
                    executor.what,
                    built,
                    type(e).__name__,
                    e,
                )
        with self._lock:
            if self._closed:
                return
            self.executors.append(executor)
            unsettled = [size for size in executor.sizes if size not in executor.settled_sizes]
            if not unsettled:
                return
            self._pending += len(unsettled)
            self._idle.clear()
            for size in unsettled:
                self._jobs.put((size, next(self._order), executor))
            if self._thread is None:
                self._start_thread()

    def _start_thread(self) -> None:
        # One thread per job: the graphs a job runs (to check and time them) give its thread an OpenMP
        # team, and while that team lives libgomp counts more threads than cores and its idle workers
        # stop spinning between parallel regions, so every step of the engine waits on futex wake-ups
        # (docs/tuning.md, executor). The team ends with its thread.
        self._thread = threading.Thread(target=self._run, name="ember-compile", daemon=True)
        self._thread.start()

    def resume(self) -> None:
        """Let a paused compiler start (idempotent)."""
        self._go.set()

    @property
    def ready_shapes(self) -> int:
        """Decode step shapes (batch size x query length, of every executor) that run compiled now."""
        return sum(len(e.ready) for e in self.executors)

    def fit_step_threads(self) -> None:
        """Called by the engine's thread before each step: while a job compiles, steps use one intra-op
        thread and leave the other cores to it. With all of them, the step's OpenMP team waits at every
        barrier for a worker the compile thread has pushed off its core, and decode slows several-fold
        beside a loading graph (docs/tuning.md, executor). The graphs'
        OpenMP regions take the thread count of the thread that runs them, and inductor's own loop
        splits are fixed at the engine's count (compile option cpp.threads), so a graph built meanwhile
        is the one a full team runs."""
        want = 1 if self.active else self.step_threads
        if want != self._step_threads_now:
            torch.set_num_threads(want)
            self._step_threads_now = want

    @property
    def active(self) -> bool:
        """Whether a job is compiling right now (not waiting for demand, not between jobs)."""
        return self._active.is_set()

    @property
    def done(self) -> bool:
        return self._idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted executor has compiled (or failed, falling back to eager);
        False if `timeout` seconds passed first."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        """One job (a batch size of one executor), then this thread ends; the next job gets a new one."""
        self._go.wait()
        size, _, executor = self._jobs.get()
        self._wait_for_demand(size)
        with self._lock:
            if self._guard is None and not self._closed:
                self._guard = _start_guard()
        self._active.set()
        try:
            if not self._closed:
                executor.warmup(background=True, sizes=[size])
        except CompileCancelled:
            pass  # close() asked for it: the process is ending, nothing to report
        except Exception as e:  # noqa: BLE001 - a failed compile leaves those steps eager, never the engine down
            if self._closed:
                return  # its compilers were ended by close(): not a failure of the compile
            self.failures.append(f"{executor.what} batch {size}: {type(e).__name__}: {e}")
            logger.warning(
                "%s: background compile of batch %d failed (%s: %s); its steps keep running eagerly",
                executor.what,
                size,
                type(e).__name__,
                e,
            )
        finally:
            self._active.clear()
            with self._lock:
                self._pending -= 1
                if self._pending == 0 or self._closed:
                    self._stop_guard()
                    self._idle.set()
                    self._thread = None
                else:
                    self._start_thread()

    def _wait_for_demand(self, size: int) -> None:
        """A batch size above the smallest waits until a step could use it (as many requests are in the
        engine) or the engine has been idle for IDLE_BEFORE_LARGER_SIZES_S: compiling traces under the
        GIL and takes a core, and a step beside it slows (docs/tuning.md, executor), so one user's chat keeps its cores until it pauses. Under a steady
        single stream the larger sizes wait: no step of that stream would use them."""
        smallest = min((e.sizes[0] for e in self.executors), default=size)
        if size <= smallest or self.demand is None:
            return
        idle_since = None
        while not self._closed:
            waiting = self.demand()
            if waiting >= size:
                return
            now = time.monotonic()
            idle_since = (idle_since or now) if waiting == 0 else None
            if idle_since is not None and now - idle_since >= IDLE_BEFORE_LARGER_SIZES_S:
                return
            time.sleep(0.2)

    def _stop_guard(self) -> None:
        if self._guard is not None:
            self._guard.terminate()
            self._guard.wait()
            self._guard = None

    def close(self) -> None:
        """No new compile starts; a running one is cancelled (its package worker and compilers ended,
        its work lost; inductor's cache and finished packages keep what was done) and its thread joined,
        so that no compile runs on while the interpreter tears down (which aborts the process). Runs at
        exit too; a second call does nothing."""
        with self._lock:
            self._closed = True
            busy = self._pending > 0
            executors = list(self.executors)
            thread = self._thread
        if busy:
            self._go.set()  # a paused job wakes, sees the close and ends
            for executor in executors:
                executor.cancel()
            deadline = time.monotonic() + CLOSE_JOIN_S
            while thread is not None and thread.is_alive() and time.monotonic() < deadline:
                _end_children()  # compilers a trace started since the last look
                thread.join(0.25)
            if thread is not None and thread.is_alive():
                logger.warning("background compile: still running %.0f s after it was cancelled", CLOSE_JOIN_S)
        with self._lock:
            self._stop_guard()


def _end_children() -> None:
    """End the compile processes this process started (inductor's compile workers, what they run, and
    compilers run from the compile thread); other children (a user's) are left alone."""
    import psutil

    from ember.engine.executor.compile_guard import compile_descendants, end

    end(compile_descendants(psutil.Process()))


def _start_guard() -> subprocess.Popen | None:
    """The compile guard (ember.engine.executor.compile_guard) for this process: if it is SIGKILLed mid-compile,
    the guard ends its compilers. In a session of its own, so that a Ctrl-C meant for the engine
    leaves the guard to clean up."""
    try:
        return subprocess.Popen(
            [sys.executable, "-m", "ember.engine.executor.compile_guard", str(os.getpid())],
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError as e:
        logger.warning("background compile: no compile guard (%s); a SIGKILLed engine may leave a compiler running", e)
        return None
