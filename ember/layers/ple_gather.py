"""The PLE row gather as an op of a step's graph, issued as soon as the step's ids are known.

qwen4_exp's n-gram table is read by row from its file (ember.layers.table_rows: pread, a GGUF type
dequantized per gathered row), never resident. Which rows a token reads depends only on its ids, so the
model hashes them before its first layer runs (PLELayer.start) and hands the rows to `prefetch`: a
thread of its own preads them while layers 0.. run, and the PLE layer takes them with `take`, which
dequantizes them on the step's own threads (the prefetch thread runs no torch op that would start an
OpenMP team of its own: see `start`). A cold
table's rows come from the disk (~0.1 ms a row on NVMe, 16 rows a token), which the layers before the PLE
hide; a warm one's from the page cache (~2 us a row).

In a compiled or exported step the same two calls are ops (torch.library, with fake kernels), so the
graph calls them as it calls ember's C++ kernels, with no hand-off to Python around the graph:
    ticket = ember::ple_prefetch(rows, key, dtype)      at the model's start
    e      = ember::ple_rows(rows, ticket, key, dtype)  in the PLE layer (the ticket orders the two)
The table is found by a key (the MoE op's way, ember.layers.moe_compute), which for a table in a file
is a digest of where its rows live (path, offset, type, shape): the same model loaded by a later process
registers the same key, so an AOTInductor package that holds it finds that process's table. A table held
in memory (TensorRows: a test's) gets a key of this process only, and a graph that holds one is never
packaged (holds_process_keys).
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ember.kernels.tracing import tracing

_tables: dict[str, weakref.WeakSet] = {}  # key -> the live tables under it (one model loaded by many engines)
_local = itertools.count()
_LOCAL_PREFIX = "ple-local-"
_lock = threading.Lock()
_pending: dict[str, tuple[torch.Tensor, Future]] = {}  # key -> the read started last (its rows, its future)
_executor: ThreadPoolExecutor | None = None


def table_key(table) -> str:
    """A key for `table` (an ember.layers.ple.NGramTable): where its rows live, or a key of this process
    for rows held in memory."""
    parts = [table.num_rows, table.dim, None if table.columns is None else (table.columns.start, table.columns.stop)]
    for source in table.shards:
        where = getattr(source, "identity", None)
        if where is None:
            return f"{_LOCAL_PREFIX}{next(_local)}"
        parts.append(where())
    return "ple-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def register_table(table) -> str:
    """Register a complete table: the key ember::ple_rows finds it by (alive as long as the table is)."""
    key = table_key(table)
    with _lock:
        _tables.setdefault(key, weakref.WeakSet()).add(table)
    return key


def holds_process_keys(model: torch.nn.Module) -> bool:
    """Whether a traced step of `model` would hold a table key of this process only (a table in memory)."""
    return any(str(getattr(m, "gather_key", "")).startswith(_LOCAL_PREFIX) for m in model.modules())


def _table(key: str):
    with _lock:
        live = next(iter(_tables.get(key, ())), None)
    if live is None:
        raise RuntimeError(f"no PLE table is registered under {key} (its model was freed)")
    return live


def _thread() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-ple-rows")
    return _executor


def start(key: str, rows: torch.Tensor, dtype: torch.dtype) -> None:
    """Begin reading rows [T, R] of the table under key on the prefetch thread (eager form). The thread only
    reads (NGramTable.fetch: no torch op that runs on OpenMP threads, whose workers stop spinning between a
    step's ops once a second thread has entered a parallel region); take() dequantizes on the step's threads."""
    rows = rows.detach().to("cpu", copy=True)  # the caller's buffer may be reused before the thread reads it
    future = _thread().submit(_table(key).fetch, rows)
    with _lock:
        _pending[key] = (rows, future)


def take(key: str, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows [T, R] gathered -> [T, R, width]: the prefetched read when it was of these rows (joined),
    else read now."""
    with _lock:
        pending = _pending.pop(key, None)
    if pending is not None:
        started, future = pending
        fetched = future.result()  # joined whatever it was: a stale read must not outlive its step
        if started.shape == rows.shape and torch.equal(started, rows.cpu()):
            return _table(key).finish(fetched, dtype).to(rows.device)
    return _table(key).gather(rows, dtype)


def prefetch(key: str, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """start(), as an op where the step is being traced: returns the ticket to hand to gather()."""
    if tracing(rows):
        return torch.ops.ember.ple_prefetch(rows, key, dtype)
    start(key, rows, dtype)
    return None


def gather(key: str, rows: torch.Tensor, dtype: torch.dtype, ticket: torch.Tensor | None) -> torch.Tensor:
    """take(), as an op where the step is being traced (after the prefetch whose ticket it takes)."""
    if tracing(rows):
        if ticket is None:
            ticket = rows.new_zeros(1)
        return torch.ops.ember.ple_rows(rows, ticket, key, dtype)
    return take(key, rows, dtype)


@torch.library.custom_op("ember::ple_prefetch", mutates_args=())
def ple_prefetch(rows: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
    """Start the gather of rows [T, R] (a compiled step's first PLE op); returns a ticket for ple_rows."""
    start(key, rows, dtype)
    return rows.new_zeros(1)


@ple_prefetch.register_fake
def _(rows: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
    return rows.new_empty(1)


@torch.library.custom_op("ember::ple_rows", mutates_args=())
def ple_rows(rows: torch.Tensor, ticket: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
    """The table's rows [T, R] -> [T, R, width] in dtype (the prefetched gather, joined, where one was started)."""
    return take(key, rows, dtype)


@ple_rows.register_fake
def _(rows: torch.Tensor, ticket: torch.Tensor, key: str, dtype: torch.dtype) -> torch.Tensor:
    return rows.new_empty((*rows.shape, _table(key).width), dtype=dtype)
