"""A tensor-parallel worker (rank >= 1): join the group, load this rank's shard, replay rank 0's calls.

Started by rank 0 (ember.engine.tp.group, one spawned process per rank) or, across nodes, by
torchrun (every rank runs the same `ember ...` command; ranks >= 1 end up here). A worker never
outlives rank 0: it exits on rank 0's "stop", when rank 0's connections close (a blocked
broadcast raises), or when its parent process changes (rank 0 killed outright).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

logger = logging.getLogger("ember")


def _exit_with_parent(parent_pid: int) -> None:
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="ember-tp-parent-watch", daemon=True).start()


def serve(rank: int, world_size: int, store, config, device_type: str, local_rank: int) -> None:
    """Join, start up as rank 0 does (ember.engine.startup: device, weights), replay until "stop"."""
    from ember.distributed import parallel_state
    from ember.distributed.comm import recv_call
    from ember.engine.startup.device import init_device
    from ember.engine.startup.weights import load_weights
    from ember.engine.tp.config import tp_quantization
    from ember.engine.tp.mirror import Replayer

    # rank 0's device type (its --device auto already resolved); on CUDA, this rank's GPU
    setup = init_device(config, world_size, local_rank, device_type)
    parallel_state.init(rank, world_size, store, "nccl" if setup.device.type == "cuda" else "gloo")
    with parallel_state.sharding(rank, world_size):
        load = config.load_config
        loaded, _ = load_weights(config, setup, tp_quantization(load.quantization, load.model), tensor_parallel=True)
        mtp = None
        spec = config.speculative
        if spec is not None and spec.method == "mtp":
            from ember.spec.mtp_weights import load_mtp

            mtp = load_mtp(loaded.model, loaded.path, spec.model, progress=False)
    replayer = Replayer(loaded.model, mtp, setup.device)
    logger.info(
        "tensor-parallel rank %d/%d ready on %s (%.1f MB weights)",
        rank,
        world_size,
        setup.device,
        loaded.weight_bytes / 1e6,
    )
    while True:
        op, args = recv_call(setup.device)
        if op == "stop":
            break
        replayer.run(op, args)


def run_worker(rank: int, world_size: int, host: str, port: int, config, device_type: str, parent_pid: int) -> None:
    """Main of a worker process started by rank 0 (see __main__ below)."""
    import signal

    import torch.distributed as dist

    from ember.distributed import parallel_state

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp{rank} %(levelname)s %(message)s")
    # Ctrl-C reaches the whole process group; rank 0 decides when workers stop (it sends "stop").
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _exit_with_parent(parent_pid)
    code = 0
    try:
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=parallel_state.data_timeout())
        store.set(f"ember_tp_joined_{rank}", "1")
        serve(rank, world_size, store, config, device_type, rank)
    except BaseException:  # noqa: BLE001 -- report, then exit non-zero: rank 0 sees the exit code
        logger.exception("tensor-parallel rank %d failed", rank)
        code = 1
    finally:
        parallel_state.destroy()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":  # python -m ember.engine.tp.worker RANK WORLD HOST PORT DEVICE PARENT_PID < config
    import pickle

    _rank, _world, _host, _port, _device, _parent = sys.argv[1:7]
    _config = pickle.loads(sys.stdin.buffer.read())
    run_worker(int(_rank), int(_world), _host, int(_port), _config, _device, int(_parent))
