"""Package workers: AOTInductor packages built in a process of their own, never in a serving engine's.

Building a package (torch.export of the decode step, inductor's lowering, g++) holds several GiB
above the model for a minute or more: ~6.4 GiB at the peak for the Q8_0 hybrid of
benchmarks/hybrid.md. Built inside the engine, that peak stayed in the engine's resident set (glibc
keeps the freed heap; VmHWM keeps the peak), the build held the GIL the engine's eager steps need,
and a build that crashed or ran out of memory took the server with it. A worker is a fresh
process that starts an engine of the same configuration (so the same graph identity, batch sizes,
thread count and package paths), builds the packages it was given into the compile cache, and
exits; the serving engine then loads them from disk, as a restart does.

This module is the parent's side; the worker's process is ember.entrypoints.package_worker:

    python -m ember.entrypoints.package_worker PARENT_PID CONFIG_FILE JOB [JOB ...]

A JOB is "what|batch size|query length" (what: the executor's name, "compiled executor" or "MTP
fill"). The worker ends with the process that started it (Linux's parent-death signal), and its
parent's BackgroundCompiler ends it on close, like inductor's compile workers.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import tempfile

logger = logging.getLogger("ember")

WORKER_MODULE = "ember.entrypoints.package_worker"
# set in a worker's environment: its engine builds in-process (a worker never starts workers)
IN_WORKER = "EMBER_PACKAGE_WORKER"
# set in a guest's: the torch threads it runs with once its engine has started (its graphs are still
# built for the engine's thread count, which the executors read at start)
GUEST_THREADS = "EMBER_PACKAGE_WORKER_THREADS"
# where a worker writes its own peak RSS (VmHWM, bytes) as it exits: the rusage that wait4 reports
# counts the forked child's pages from before its exec, which are its parent's (a serving engine's
# 3.8 GiB was reported as a worker's peak that way)
PEAK_REPORT = "EMBER_PACKAGE_WORKER_PEAK_FILE"
STDERR_TAIL = 2000  # characters of a failed worker's stderr that go to the log


def in_worker() -> bool:
    return os.environ.get(IN_WORKER) == "1"


def write_peak_report() -> None:
    """In a worker, as it exits: its own VmHWM into the file its parent named (PEAK_REPORT)."""
    path = os.environ.get(PEAK_REPORT)
    if not path:
        return
    try:
        with open("/proc/self/status") as f:
            peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        with open(path, "w") as f:
            f.write(str(peak))
    except (OSError, StopIteration):  # no procfs: the parent falls back to the rusage
        pass


def _worker_env(guest: bool) -> dict:
    """This process's environment, with this ember first on the path (the worker runs the same code
    whatever directory it starts in). A guest (a worker beside an engine that serves) compiles with one
    inductor compile process, not one a core, and one torch thread once its engine has started: a core
    stays the engine's (issue 53)."""
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))  # above ember/
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, **{IN_WORKER: "1"})
    if guest:
        env["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
        env[GUEST_THREADS] = "1"
    return env


class PackageWorker:
    """One worker process building `jobs` for an engine of `config`; wait() says whether it succeeded."""

    def __init__(self, config, jobs: list[str], guest: bool = False):
        """guest: the worker runs beside an engine that serves (a background compile), not for `ember compile`."""
        self.jobs = list(jobs)
        self.cancelled = False
        self.peak_rss_bytes = 0  # the worker's high-water mark, once it has ended
        fd, self._config_file = tempfile.mkstemp(prefix="ember-package-worker-", suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(config, f)
        self._stderr = tempfile.TemporaryFile()
        fd, self._peak_file = tempfile.mkstemp(prefix="ember-package-worker-", suffix=".peak")
        os.close(fd)
        self.process = subprocess.Popen(
            [sys.executable, "-m", WORKER_MODULE, str(os.getpid()), self._config_file, *self.jobs],
            env=_worker_env(guest) | {PEAK_REPORT: self._peak_file},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )

    def wait(self) -> bool:
        """Wait for the worker; False (and, unless it was cancelled, its stderr's tail in the log) when it failed."""
        try:
            rc = self._wait_with_usage()
            if rc != 0 and not self.cancelled:
                self._stderr.seek(0)
                tail = self._stderr.read().decode(errors="replace")[-STDERR_TAIL:]
                logger.warning("package worker for %s exited with %d:\n%s", ", ".join(self.jobs), rc, tail)
            return rc == 0
        finally:
            self._release()

    def _wait_with_usage(self) -> int:
        """The worker's exit code, reaped with its resource usage: its peak RSS is the build's cost in memory."""
        try:
            _, status, usage = os.wait4(self.process.pid, 0)
        except ChildProcessError:  # reaped already (a second wait)
            return self.process.wait()
        self.process.returncode = os.waitstatus_to_exitcode(status)
        try:
            with open(self._peak_file) as f:
                self.peak_rss_bytes = int(f.read())
        except (OSError, ValueError):  # it died before writing: the rusage, an upper bound (PEAK_REPORT)
            self.peak_rss_bytes = usage.ru_maxrss * 1024  # KiB on Linux
        return self.process.returncode

    def cancel(self) -> None:
        """End the worker without a word in the log (its engine is closing)."""
        self.cancelled = True
        if self.process.poll() is None:
            self.process.terminate()

    def terminate(self) -> None:
        """End the worker if it still runs (an interrupted `ember compile`), and drop its files."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait()
        self._release()

    def _release(self) -> None:
        self._stderr.close()  # closing twice is harmless
        for path in (self._config_file, self._peak_file):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass


def job_name(what: str, shape: tuple[int, int]) -> str:
    return f"{what}|{shape[0]}|{shape[1]}"


def worker_config(config, device_type: str, pool, max_model_len: int, max_num_seqs: int):
    """The engine a worker starts: its parent's, but with a KV pool of what a build touches (one sequence
    of max_model_len and a block per batch row) and no prefix-cache state snapshots, not the parent's
    serving pool (~2 GiB by default on CPU; a hybrid's snapshots, 2 x max_num_seqs slots zero-filled at
    start, were ~600 MiB of the bf16 hybrid worker's peak). kv_cache_memory and max_state_snapshots
    change no traced graph (compile_cache.NOT_IN_GRAPHS; the state pool's slot count is a dynamic
    dimension of a package), so the packages' identity and paths are the parent's.
    pool: the parent's planner.KVPool (its budget_bytes: the budget less the recurrent states)."""
    import dataclasses

    from ember.engine.planner import GiB, cpu_kv_budget_bytes

    if device_type != "cpu":
        return config
    budget = cpu_kv_budget_bytes(config)
    blocks = -(-max_model_len // pool.block_size) + max_num_seqs + 1
    slots = max_num_seqs + config.cache_config.state_snapshots(max_num_seqs)  # the parent's state slots
    live = (budget - pool.budget_bytes) * max_num_seqs / slots  # their bytes but the snapshots'
    need = live + blocks * pool.block_bytes  # the states, then the blocks
    if need >= budget:
        return config
    return dataclasses.replace(config, kv_cache_memory=need / GiB, max_state_snapshots=0)


def worker_peak_bytes(worker_cfg, model) -> int:
    """What a worker of `worker_cfg` (worker_config's) is expected to take at its peak with its compiler
    (peak_rss.package_worker_bytes, the figure `ember plan` states): its pool, and `model`'s largest
    tensor, the one its shapes-only load holds at a time (ember.loader.shapes_only)."""
    from ember.engine import peak_rss
    from ember.engine.planner import cpu_kv_budget_bytes
    from ember.loader.shapes_only import tensors_held

    largest = max((t.numel() * t.element_size() for m in model.modules() for t in tensors_held(m)), default=0)
    return peak_rss.package_worker_bytes(peak_rss.PROCESS_BYTES, largest, 0, int(cpu_kv_budget_bytes(worker_cfg)))


class PackageWorkers:
    """What an engine hands its compiled executors: build(what, shapes) runs one worker to the end, when
    this machine has the memory it takes (peak_bytes: worker_peak_bytes; 0: not checked)."""

    def __init__(self, config, peak_bytes: int = 0):
        self.config = config
        self.peak_bytes = peak_bytes
        self.cancelled = False
        self.peak_rss_bytes = 0  # the largest high-water mark of a worker so far (reported in the log too)
        self._running: PackageWorker | None = None

    def build(self, what: str, shapes: list[tuple[int, int]]) -> bool:
        """Run one worker for `shapes` to its end; False when it failed, was cancelled, or did not start for
        want of memory (its shapes then run eagerly, and the log says how to build them)."""
        if self.cancelled or not self._fits(what, shapes):
            return False
        worker = self._running = PackageWorker(self.config, [job_name(what, s) for s in shapes], guest=True)
        if self.cancelled:  # cancel() ran between the check and the start
            worker.cancel()
        try:
            ok = worker.wait() and not self.cancelled
            self.peak_rss_bytes = max(self.peak_rss_bytes, worker.peak_rss_bytes)
            if ok:
                logger.info("%s: the package worker's peak RSS was %.0f MiB", what, worker.peak_rss_bytes / 2**20)
            return ok
        finally:
            self._running = None

    def _fits(self, what: str, shapes: list[tuple[int, int]]) -> bool:
        """Whether the build's expected peak fits in the memory available now; if not, a warning."""
        from ember.platform import available_ram_bytes

        available = available_ram_bytes()
        if not self.peak_bytes or self.peak_bytes <= available:
            return True
        logger.warning(
            "%s: the packages of %s are not built: a package build takes ~%.0f MiB at its peak (a worker and "
            "its compiler; `ember plan` counts it) and %.0f MiB are available. Their steps run eagerly; "
            "`ember compile` with this engine's flags builds them when the memory is free, and a restart loads them",
            what,
            shapes,
            self.peak_bytes / 2**20,
            available / 2**20,
        )
        return False

    def cancel(self) -> None:
        """End the running worker (its engine is closing) and start no other: no log line, nothing kept."""
        self.cancelled = True
        worker = self._running
        if worker is not None:
            worker.cancel()
