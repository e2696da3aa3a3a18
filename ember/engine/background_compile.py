"""BackgroundCompiler: compiled CPU graphs built on a thread while the engine serves eagerly.

`--executor auto` on CPU is the compiled executor, built this way: the engine answers at once
(eager steps), one daemon thread compiles each CompiledExecutor's shapes in turn (the model's
decode steps, then the MTP fill's), and a shape starts running compiled at the first step after
its graph is ready and checked. A cold compile costs ~45 s per shape of the default model on 2 cores
(~7 s from torch's on-disk caches on a later start); `--executor compiled` compiles in the foreground
instead, before the engine takes a request.

The thread never touches the engine's KV pool: it compiles against scratch caches of the pool's
shape (the pool's block count is a dynamic dimension of every graph) and publishes a shape only
when dynamo's guards pass for the real pool. It runs at serving's own CPU priority: at nice 10,
as it first did, a busy server left its compilers about 5% of a core (CFS weights 110 against
1024 a thread), and a first compile of the default model had not finished after 240 s of
continuous requests (issue 38). At equal priority its compiler takes about a third of two cores
while it runs, and eager steps slow by about as much, for the minutes of a first compile only (a
restart loads the graphs from torch's caches in seconds: ember.engine.compile_cache); the GIL
still slows eager steps while it traces. When the engine's process ends (exit, Ctrl-C, SIGTERM),
compilers it started are ended with it (close); for a SIGKILLed one, a compile guard process
(ember.engine.compile_guard, alive only while a compile runs) ends them.
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

logger = logging.getLogger("ember")


class BackgroundCompiler:
    def __init__(self, paused: bool = False):
        """paused: jobs wait for resume() (a server warms up first, then compiles)."""
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
        self._go = threading.Event()
        if not paused:
            self._go.set()
        atexit.register(self.close)

    def submit(self, executor) -> None:
        """Queue executor.warmup(background=True, sizes=[b]) for each of its batch sizes b. Jobs run one
        at a time, smallest size first across executors (the model's batch-1 graphs, then the MTP
        fill's, then batch 2, ...), in submission order within a size."""
        with self._lock:
            if self._closed:
                return
            self._pending += len(executor.sizes)
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ember-compile", daemon=True)
                self._thread.start()
        self.executors.append(executor)
        for size in executor.sizes:
            self._jobs.put((size, next(self._order), executor))

    def resume(self) -> None:
        """Let a paused compiler start (idempotent)."""
        self._go.set()

    @property
    def ready_shapes(self) -> int:
        """Decode step shapes (batch size x query length, of every executor) that run compiled now."""
        return sum(len(e.ready) for e in self.executors)

    @property
    def done(self) -> bool:
        return self._idle.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted executor has compiled (or failed, falling back to eager);
        False if `timeout` seconds passed first."""
        return self._idle.wait(timeout)

    def _run(self) -> None:
        while True:  # until the queue is empty: see the finally below
            self._go.wait()
            size, _, executor = self._jobs.get()
            if self._guard is None and not self._closed:
                self._guard = _start_guard()
            try:
                if not self._closed:
                    executor.warmup(background=True, sizes=[size])
            except Exception as e:  # noqa: BLE001 - a failed compile leaves those steps eager, never the engine down
                self.failures.append(f"{executor.what} batch {size}: {type(e).__name__}: {e}")
                logger.warning("%s: background compile of batch %d failed (%s: %s); its steps keep running eagerly",
                               executor.what, size, type(e).__name__, e)
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._stop_guard()
                        self._idle.set()
                        # The thread ends with its last job (submit starts another): its OpenMP team
                        # (the graphs it ran to check and time them) goes with it. While that team
                        # lives, libgomp counts more threads than cores and its idle workers stop
                        # spinning between parallel regions: every compiled step then waits on
                        # futex wake-ups (measured: batch-1 decode 58-72 instead of 127-164 tok/s).
                        self._thread = None
                        return

    def _stop_guard(self) -> None:
        if self._guard is not None:
            self._guard.terminate()
            self._guard.wait()
            self._guard = None

    def close(self) -> None:
        """No new compile starts; if one is running, the compile workers and compilers this process
        started are ended (their work is lost; inductor's cache keeps what finished)."""
        with self._lock:
            self._closed = True
            busy = self._pending > 0
        if busy:
            _end_children()
        with self._lock:
            self._stop_guard()


def _end_children() -> None:
    """End the compile processes this process started (inductor's compile workers, what they run, and
    compilers run from the compile thread); other children (a user's) are left alone."""
    import psutil

    from ember.engine.compile_guard import compile_descendants, end

    end(compile_descendants(psutil.Process()))


def _start_guard() -> subprocess.Popen | None:
    """The compile guard (ember.engine.compile_guard) for this process: if it is SIGKILLed mid-compile,
    the guard ends its compilers. In a session of its own, so that a Ctrl-C meant for the engine
    leaves the guard to clean up."""
    try:
        return subprocess.Popen([sys.executable, "-m", "ember.engine.compile_guard", str(os.getpid())],
                                stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as e:
        logger.warning("background compile: no compile guard (%s); a SIGKILLed engine may leave a compiler running", e)
        return None
