"""This process's place in the tensor-parallel group: (rank, world size) and the torch.distributed groups.

Two pieces of state, kept apart on purpose:
- the *build* shard, read by layers when they are constructed (``get_tp_rank_size``): it is set
  only while a TP engine builds its model (``sharding``), so a TP=1 model built in the same
  process is never sharded by accident;
- the *groups*, used at run time by ember.distributed.comm: ``data`` carries the collectives of
  the forward (all_reduce / all_gather, timed out after ``EMBER_TP_TIMEOUT_S``, default 60 s, so a
  hung peer cannot hang rank 0) and the step inputs; ``control`` (gloo, no practical timeout)
  carries only the small pickled step header that workers wait on while the engine is idle.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

_build: tuple[int, int] = (0, 1)
_state: "TPState | None" = None

# Workers wait on the control group between requests; a server may idle for days.
IDLE_TIMEOUT = timedelta(days=3650)


def data_timeout() -> timedelta:
    return timedelta(seconds=float(os.environ.get("EMBER_TP_TIMEOUT_S", "60")))


@dataclass
class TPState:
    rank: int
    world_size: int
    data: object  # ProcessGroup for collectives and step tensors (nccl on CUDA, gloo on CPU)
    control: object  # gloo ProcessGroup for the pickled step header


def get_tp_rank_size() -> tuple[int, int]:
    """(rank, size) the layers being built now are sharded for; (0, 1) outside ``sharding``."""
    return _build


@contextmanager
def sharding(rank: int, world_size: int):
    """Build layers for shard ``rank`` of ``world_size`` inside this block."""
    global _build
    saved, _build = _build, (rank, world_size)
    try:
        yield
    finally:
        _build = saved


def get_state() -> TPState | None:
    return _state


def init(rank: int, world_size: int, store, backend: str) -> TPState:
    """Join the group through ``store`` (a c10d TCPStore); every rank calls this, in any order."""
    global _state
    if _state is not None:
        raise RuntimeError("this process is already in a tensor-parallel group; shut that engine down first")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=IDLE_TIMEOUT)
    control = dist.group.WORLD
    data = dist.new_group(list(range(world_size)), backend=backend, timeout=data_timeout())
    _state = TPState(rank, world_size, data, control)
    return _state


def destroy() -> None:
    global _state
    _state = None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # a peer already gone: nothing left to tear down cleanly
            pass
