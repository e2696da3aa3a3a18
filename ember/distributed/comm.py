"""Collectives over torch.distributed (never a transport of our own), timed for the engine.

all_reduce / all_gather are what the sharded layers call in their forward; with no TP group (or
a layer built for one rank) they are never reached. ``stats`` sums the host time spent in them
(on CUDA that is enqueue time, NCCL being asynchronous) and in the step-input broadcasts, so
the engine can report communication time per step.

send_call / recv_call move one call from rank 0 to the workers: a pickled header (op name and the
arguments' structure: lists, scalars, dataclasses such as AttentionMetadata) on the control group,
then every tensor argument, concatenated per dtype, broadcast on the data group.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist

from ember.distributed.parallel_state import get_state


@dataclasses.dataclass
class CommStats:
    seconds: float = 0.0  # in all_reduce / all_gather
    broadcast_seconds: float = 0.0  # step inputs rank 0 -> workers
    calls: int = 0

    def reset(self) -> None:
        self.seconds, self.broadcast_seconds, self.calls = 0.0, 0.0, 0


stats = CommStats()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum x over the TP ranks, in place; returns x."""
    st = get_state()
    t0 = time.perf_counter()
    dist.all_reduce(x, group=st.data)
    stats.seconds += time.perf_counter() - t0
    stats.calls += 1
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's x along dim, in rank order."""
    st = get_state()
    t0 = time.perf_counter()
    parts = [torch.empty_like(x) for _ in range(st.world_size)]
    dist.all_gather(parts, x.contiguous(), group=st.data)
    out = torch.cat(parts, dim=dim)
    stats.seconds += time.perf_counter() - t0
    stats.calls += 1
    return out


@dataclasses.dataclass(frozen=True)
class _Slot:  # a tensor argument's place in the header
    index: int
    shape: tuple
    dtype: torch.dtype


def _flatten(obj, tensors: list):
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return _Slot(len(tensors) - 1, tuple(obj.shape), obj.dtype)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (_Data, type(obj), {f.name: _flatten(getattr(obj, f.name), tensors) for f in dataclasses.fields(obj)})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_flatten(o, tensors) for o in obj)
    return obj


class _Data:  # marks a flattened dataclass
    pass


def _unflatten(obj, tensors: list):
    if isinstance(obj, _Slot):
        return tensors[obj.index]
    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] is _Data:
        return obj[1](**{k: _unflatten(v, tensors) for k, v in obj[2].items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unflatten(o, tensors) for o in obj)
    return obj


def _slots(obj, out: list) -> list:
    if isinstance(obj, _Slot):
        out.append(obj)
    elif isinstance(obj, tuple) and len(obj) == 3 and obj[0] is _Data:
        for v in obj[2].values():
            _slots(v, out)
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _slots(o, out)
    return out


def send_call(op: str, *args) -> None:
    """Rank 0: tell every worker to run ``op(*args)``."""
    st = get_state()
    t0 = time.perf_counter()
    tensors: list[torch.Tensor] = []
    header = [(op, _flatten(args, tensors))]
    dist.broadcast_object_list(header, src=0, group=st.control)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t.reshape(-1))
    for ts in by_dtype.values():  # one broadcast per dtype, in first-seen order (recv_call's too)
        buf = torch.cat(ts) if len(ts) > 1 else ts[0].contiguous()
        if buf.numel():
            dist.broadcast(buf, src=0, group=st.data)
    stats.broadcast_seconds += time.perf_counter() - t0


def recv_call(device: torch.device) -> tuple[str, tuple]:
    """Worker: wait for rank 0's next call; returns (op, args) with tensors on ``device``."""
    st = get_state()
    header = [None]
    dist.broadcast_object_list(header, src=0, group=st.control)
    op, flat = header[0]
    slots = _slots(flat, [])
    tensors: list = [None] * len(slots)
    by_dtype: dict[torch.dtype, list[_Slot]] = {}
    for s in slots:
        by_dtype.setdefault(s.dtype, []).append(s)
    for dtype, group in by_dtype.items():
        sizes = [_numel(s.shape) for s in group]
        buf = torch.empty(sum(sizes), dtype=dtype, device=device)
        if buf.numel():
            dist.broadcast(buf, src=0, group=st.data)
        for s, part in zip(group, buf.split(sizes)):
            tensors[s.index] = part.view(s.shape)
    return op, _unflatten(flat, tensors)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
