"""Rank 0's handle on a tensor-parallel group: start the workers, join them, watch them, stop them.

Start (start_tensor_parallel): check the model splits (tp_config), open a c10d TCPStore on a
port the OS picks (port 0: two ember instances on one host never collide), start ranks
1..N-1 as `python -m ember.engine.tp.worker` subprocesses (not multiprocessing's spawn, which
re-runs the user's main script: a script without a __main__ guard would start engines
recursively), wait for each to check in -- polling, so a worker that
dies while starting is reported instead of waited for -- then join the process group (gloo on
CPU, NCCL on CUDA for the data; see parallel_state).

Across nodes, run the same command under torchrun, e.g. two nodes with 4 GPUs each:

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m ember.entrypoints.cli serve MODEL --tensor-parallel-size 8

With torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...) ember spawns nothing: it joins
through env:// and every rank >= 1 becomes a worker (it never returns from the engine's
constructor; it exits when rank 0 stops). Rank 0 serves.

Failure: before each step the engine calls step(); a worker that has exited is reported there
(its rank and exit code), and a collective that fails or times out mid-step (EMBER_TP_TIMEOUT_S)
becomes a DistributedError after the remaining workers are stopped -- rank 0 raises, it never
hangs. A watchdog thread logs a worker's death the moment it happens.

Shutdown: "stop" to every worker, join, then terminate / kill whatever is left; also at exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ember.distributed import comm, parallel_state
from ember.errors import DistributedError

logger = logging.getLogger("ember")
JOIN_TIMEOUT_S = 600.0  # a worker loading a big model on a busy host may take a while to check in
_current: "TensorParallelGroup | None" = None


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "MASTER_ADDR" in os.environ)


class TensorParallelGroup:
    def __init__(self, config, device: torch.device, quantization: str):
        self.world_size = config.parallel_config.tensor_parallel_size
        self.quantization = quantization
        self.procs = []
        self.closed = False
        self.last_step_comm_seconds = 0.0
        self.last_step_broadcast_seconds = 0.0
        self.total_comm_seconds = 0.0
        backend = "nccl" if device.type == "cuda" else "gloo"
        if under_torchrun():
            store, rank, world = next(dist.rendezvous("env://", timeout=timedelta(seconds=JOIN_TIMEOUT_S)))
            if world != self.world_size:
                raise DistributedError(
                    f"torchrun started {world} processes but --tensor-parallel-size is "
                    f"{self.world_size}; make them equal"
                )
            if rank != 0:  # this process is a worker: serve rank 0, then leave
                from ember.engine.tp.worker import serve

                local = int(os.environ.get("LOCAL_RANK", rank))
                try:
                    serve(rank, world, store, config, device.type, local)
                finally:
                    parallel_state.destroy()
                raise SystemExit(0)
            parallel_state.init(0, world, store, backend)
        else:
            store = dist.TCPStore(
                "127.0.0.1",
                0,
                self.world_size,
                is_master=True,
                wait_for_workers=False,
                timeout=parallel_state.data_timeout(),
            )
            self._spawn(config, device, store)
            self._await_checkin(store)
            parallel_state.init(0, self.world_size, store, backend)
            for p in self.procs:
                threading.Thread(target=self._watch, args=(p,), name="ember-tp-watchdog", daemon=True).start()
        self._store = store  # kept alive: it is the group's rendezvous server
        atexit.register(self.shutdown)
        logger.info(
            "tensor parallel: %d ranks (%s)%s",
            self.world_size,
            backend,
            "" if under_torchrun() else f", workers pid {[p.pid for p in self.procs]}",
        )

    # -- start ------------------------------------------------------------------------------
    def _spawn(self, config, device, store) -> None:
        env = dict(os.environ)
        # The child imports the same ember as this process, installed or not.
        root = str(Path(__file__).resolve().parents[3])  # the folder that holds ember/ (this is ember/engine/tp/)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        blob = pickle.dumps(config)
        for rank in range(1, self.world_size):
            cmd = [
                sys.executable,
                "-m",
                "ember.engine.tp.worker",
                str(rank),
                str(self.world_size),
                "127.0.0.1",
                str(store.port),
                device.type,
                str(os.getpid()),
            ]
            p = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            p.stdin.write(blob)  # the EngineConfig: how to load this rank's shard
            p.stdin.close()
            self.procs.append(p)

    def _await_checkin(self, store) -> None:
        keys = [f"ember_tp_joined_{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not store.check(keys):
            self.check()
            if time.monotonic() > deadline:
                self.shutdown(graceful=False)
                raise DistributedError(f"tensor-parallel workers did not check in within {JOIN_TIMEOUT_S:.0f} s")
            time.sleep(0.05)

    # -- health -----------------------------------------------------------------------------
    def dead_workers(self) -> list[str]:
        return [
            f"rank {r} (pid {p.pid}) exited with code {p.returncode}"
            for r, p in enumerate(self.procs, 1)
            if p.poll() is not None
        ]

    def check(self) -> None:
        """Raise DistributedError (after stopping the rest) if a worker has exited."""
        if self.closed:
            raise DistributedError("the tensor-parallel group was shut down; start a new engine")
        dead = self.dead_workers()
        if dead:
            self.shutdown(graceful=False)
            raise DistributedError(
                f"tensor-parallel worker {'; '.join(dead)}; the engine cannot continue "
                "without every shard. Check the worker's log above, then restart"
            )

    def _watch(self, proc) -> None:
        proc.wait()
        if not self.closed:
            logger.error("tensor-parallel worker %s; rank 0 raises at its next step", "; ".join(self.dead_workers()))

    @contextmanager
    def step(self):
        """Around one engine step: refuse to start without every worker; turn a failed collective
        into a DistributedError naming the worker; record the step's communication time."""
        self.check()
        comm.stats.reset()
        try:
            yield
        except RuntimeError as e:  # gloo / NCCL errors and timeouts are RuntimeErrors
            deadline = time.monotonic() + 2.0  # give a dying worker's exit a moment to show
            while not self.dead_workers() and time.monotonic() < deadline:
                time.sleep(0.05)
            dead = self.dead_workers()
            self.shutdown(graceful=False)
            what = f"worker {'; '.join(dead)}" if dead else "a collective failed or timed out"
            raise DistributedError(f"tensor parallelism: {what} ({e}); the engine stopped") from e
        finally:
            self.last_step_comm_seconds = comm.stats.seconds
            self.last_step_broadcast_seconds = comm.stats.broadcast_seconds
            self.total_comm_seconds += comm.stats.seconds

    # -- setup and stop -----------------------------------------------------------------------
    def setup_workers(self, runner) -> None:
        """Give the workers rank 0's cache layout (shapes are per rank already: its kv heads)."""
        comm.send_call(
            "setup",
            [tuple(c.shape) if isinstance(c, torch.Tensor) else None for c in runner.kv_caches],
            [tuple(c.shape) for c in runner.extra_kv_caches],
            runner.kv_dtype,
            runner.state_slots,
        )

    def shutdown(self, graceful: bool = True, timeout: float = 10.0) -> None:
        global _current
        if self.closed:
            return
        self.closed = True
        if graceful and not self.dead_workers():
            try:
                comm.send_call("stop")
            except Exception:  # noqa: BLE001 -- a worker went away meanwhile: the kills below cover it
                graceful = False
        for p in self.procs:
            for wait_s, end in ((timeout if graceful else 0.5, p.terminate), (2.0, p.kill), (None, None)):
                try:
                    p.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    end()
        parallel_state.destroy()
        if _current is self:
            _current = None


def start_tensor_parallel(config, device: torch.device) -> TensorParallelGroup:
    """Validate, then start the group for an engine with config.tensor_parallel_size > 1."""
    global _current
    from ember.engine.tp.config import check_tensor_parallel, model_config_for, tp_quantization

    quantization = tp_quantization(config.load_config.quantization, config.load_config.model)
    mc, awq_group = model_config_for(config.load_config.model)
    check_tensor_parallel(
        mc, config.parallel_config.tensor_parallel_size, device.type, awq_group, multi_node=under_torchrun()
    )
    if _current is not None:  # one TP engine per process: the previous one's group is torn down
        logger.warning("a previous tensor-parallel engine in this process was not shut down; stopping it")
        _current.shutdown()
    _current = TensorParallelGroup(config, device, quantization)
    return _current
