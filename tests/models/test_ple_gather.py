"""The PLE row gather (ember.layers.ple_gather): a prefetched gather is joined and gives the rows a direct
read gives, a stale one (other rows) is dropped for a direct read, the ops' fake kernels give the real
shapes, and a table in a file is keyed by where its rows live (the same key for a second load of the file:
what lets an AOTInductor package find a later process's table) while one in memory is this process's only."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ember.layers import ple_gather
from ember.layers.ple import NGramTable
from ember.layers.table_rows import FileRows, TensorRows

ROWS, DIM = 50, 6


def file_table(tmp_path, values: torch.Tensor) -> NGramTable:
    """A table of two row shards stored one after the other in one file, at an offset."""
    path = tmp_path / "table.bin"
    if not path.exists():
        path.write_bytes(b"\0" * 24 + values.numpy().tobytes())
    table = NGramTable(ROWS, DIM)
    half = ROWS // 2
    for i in range(2):
        view = values[i * half : (i + 1) * half]  # what the loader's view of the file's mapping would be
        table.add_shard(i, FileRows(view, str(path), 24 + i * half * DIM * 4), 2)
    return table


def test_a_prefetched_gather_is_joined_and_a_stale_one_dropped(tmp_path):
    values = torch.randn(ROWS, DIM)
    table = file_table(tmp_path, values)
    key = ple_gather.register_table(table)
    rows = torch.tensor([[3, 30], [48, 0], [3, 3]])
    ple_gather.start(key, rows, torch.float32)
    assert torch.equal(ple_gather.take(key, rows, torch.float32), values[rows])
    ple_gather.start(key, rows + 1, torch.float32)  # a gather of other rows: not these
    assert torch.equal(ple_gather.take(key, rows, torch.bfloat16), values[rows].bfloat16())
    assert torch.equal(ple_gather.take(key, rows, torch.float32), values[rows])  # nothing pending


class _Ops(TorchDispatchMode):
    """The aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.add(func.__name__)
        return func(*args, **(kwargs or {}))


def test_the_prefetch_thread_only_reads(tmp_path):
    """What the prefetch thread runs (NGramTable.fetch) is preads and views, no op that computes: such an op on
    a prefill's rows would enter an OpenMP parallel region from a second thread, after which OpenMP's workers
    stop spinning between a step's ops (decode steps 1.5x slower). finish() then gives the rows."""
    values = torch.randn(ROWS, DIM)
    table = file_table(tmp_path, values)
    rows = torch.randint(0, ROWS, (4096, 16), generator=torch.Generator().manual_seed(0))
    with _Ops() as ops:
        fetched = table.fetch(rows)
    assert ops.seen <= {"view.default", "detach.default", "lift_fresh.default", "_to_copy.default"}, ops.seen
    assert torch.equal(table.finish(fetched, torch.bfloat16), values[rows].bfloat16())


def test_the_ops_trace_with_the_real_shapes(tmp_path):
    values = torch.randn(ROWS, DIM)
    table = file_table(tmp_path, values)  # alive while the ops run: the registry holds it weakly
    key = ple_gather.register_table(table)
    rows = torch.tensor([[1, 2, 3], [4, 5, 6]])

    def step(rows):
        ticket = ple_gather.prefetch(key, rows, torch.float32)
        return ple_gather.gather(key, rows, torch.float32, ticket) * 2

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(rows), values[rows] * 2)
    torch.library.opcheck(torch.ops.ember.ple_rows, (rows, rows.new_zeros(1), key, torch.float32))


def test_tables_are_keyed_by_where_their_rows_live(tmp_path):
    values = torch.randn(ROWS, DIM)
    first, again = file_table(tmp_path, values), file_table(tmp_path, values)
    key = ple_gather.table_key(first)
    assert key == ple_gather.table_key(again) and not key.startswith("ple-local-")
    resident = NGramTable(ROWS, DIM)
    resident.add_shard(0, TensorRows(values), 1)
    local = ple_gather.table_key(resident)
    assert local.startswith("ple-local-") and local != ple_gather.table_key(resident)
    model = torch.nn.Module()
    model.gather_key = local
    assert ple_gather.holds_process_keys(model)
