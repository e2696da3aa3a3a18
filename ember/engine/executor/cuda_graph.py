"""CUDAGraphExecutor: decode-shaped steps replayed from captured CUDA graphs.

A decode step of a small model on a GPU is mostly kernel-launch overhead; a graph launches the
whole forward at once. Captured at startup, per query length q (1, and 1 + k when speculating
with k drafts and the attention backend runs that from fixed-shape metadata) and per batch
size in decode_batch.default_sizes(--cuda-graph-max-batch-size): 1, 2, 4, 8, 16, ...

- Static inputs: one set of buffers per q at the largest size (input_ids, positions,
  slot_mapping, query_start_loc, seq_lens, block_tables max_model_len / block_size wide); a
  graph of batch b reads their leading b rows. A step is padded to the next size
  (decode_batch.pad_decode) and copied in; padding rows have slot -1 and seq_len q.
- Metadata: decode_batch.fixed_meta. The backend sees device tensors plus the python ints
  max_query_len = q and max_seq_len = the table's bound; the torch reference does that for
  q = 1, the Triton backend for any q.
- One memory pool shared by all graphs, captured largest first so the smaller ones reuse it.
  Its size is estimated before the KV cache is sized (graph_pool_estimate) and counted inside
  --gpu-memory-utilization; capture time and the memory it took are logged.
- Runs eagerly: prefill chunks, mixed steps, steps whose requests have different draft
  counts, batches above the largest size, steps with a RowSelection.
- Per-row inputs (`row_inputs`, e.g. the MTP fill's hidden states): one static buffer each per
  q, written like the step's ids and zeroed on padding rows. The MTP proposer captures its fill
  this way, at the main executor's sizes and query lengths, into the main graphs' pool
  (mtp_proposer.MTPProposer.prepare), as the compiled CPU executor compiles it.

The CUDA calls sit in a few small methods (_synchronize, _free_bytes, _new_pool, _capture_graph)
so that tests can run the buffer, padding and replay logic on CPU with stand-in graphs.
"""

from __future__ import annotations

import logging
import time

import torch

from ember.engine.executor.decode_batch import (
    DecodeInputs,
    default_sizes,
    fixed_meta,
    graph_shape,
    leading,
    pad_decode,
    table_width,
    take_decode_snapshots,
    warmup_inputs,
)
from ember.errors import ConfigError
from ember.layers.rotary import RotaryEmbedding

logger = logging.getLogger("ember")
OOM_HINT = "lower --cuda-graph-max-batch-size, --gpu-memory-utilization or --max-num-seqs, or pass --enforce-eager"


class CUDAGraphExecutor:
    name = "cuda-graph"
    device_type = "cuda"  # tests run the logic on CPU with stand-in graphs (see the module docstring)

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_batch: int,
        query_lens: list[int],
        device: torch.device,
        row_inputs: tuple = (),
        what: str = "cuda graphs",
        pool=None,
    ):
        """row_inputs: ((shape, dtype), ...) of the model's per-row inputs after its 5 usual arguments;
        pool: a graph memory pool to share (default: a new one)."""
        if device.type != self.device_type:
            raise ConfigError(f"--executor cuda-graph needs a CUDA device, not {device.type}; use --executor eager")
        self.model, self.kv_caches, self.block_size, self.device = model, kv_caches, block_size, device
        self.max_model_len = max_model_len
        self.row_inputs, self.what, self.pool = tuple(row_inputs), what, pool
        self.sizes = default_sizes(max_batch)
        self.width = table_width(max_model_len, block_size)
        for m in model.modules():  # the cos/sin cache must not grow (a new tensor) after capture
            if isinstance(m, RotaryEmbedding):
                m.ensure_capacity(max_model_len)
        self.static: dict[int, DecodeInputs] = {}
        self.rows: dict[int, tuple[torch.Tensor, ...]] = {}  # q -> per-row input buffers (largest batch)
        self.graphs: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}
        self.replays = 0  # steps that ran from a graph (the rest ran eagerly)
        try:
            self.capture(query_lens)
        except torch.OutOfMemoryError:
            raise ConfigError(
                f"out of GPU memory while capturing CUDA graphs (batch sizes {self.sizes}, query lengths "
                f"{query_lens}); {OOM_HINT}"
            ) from None

    @property
    def query_lens(self) -> list[int]:
        return sorted(self.static)

    @torch.inference_mode()
    def capture(self, query_lens: list[int]) -> None:
        dev = self.device
        self._synchronize()
        free0, t0 = self._free_bytes(), time.perf_counter()
        if self.pool is None:
            self.pool = self._new_pool()
        for q in query_lens:
            static = self.static[q] = warmup_inputs(self.sizes[-1], q, self.width, dev)
            rows = self.rows[q] = tuple(
                torch.zeros(self.sizes[-1] * q, *shape, dtype=dtype, device=dev) for shape, dtype in self.row_inputs
            )
            for b in reversed(self.sizes):  # largest first: the smaller graphs fit in its pool memory
                x = leading(static, b, q)
                meta = fixed_meta(x, q, self.block_size)
                r = tuple(t[: b * q] for t in rows)
                self.graphs[(q, b)] = self._capture_graph(
                    lambda x=x, meta=meta, r=r: self.model(x.input_ids, x.positions, self.kv_caches, meta, None, *r)
                )
            static.slot_mapping.fill_(-1)
        for cache in self.kv_caches:  # the dummy steps wrote block 0 (and no recurrent-state slot)
            if isinstance(cache, torch.Tensor):
                cache[:, 0].zero_()
        self._synchronize()
        self.graph_bytes = free0 - self._free_bytes()
        logger.info(
            "%s: %d captured (batch sizes %s, query lengths %s) in %.1fs, %.1f MB",
            self.what,
            len(self.graphs),
            self.sizes,
            query_lens,
            time.perf_counter() - t0,
            self.graph_bytes / 1e6,
        )

    # -- the CUDA calls (stand-ins in tests) ------------------------------------------------------
    def _synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def _free_bytes(self) -> int:
        return torch.cuda.mem_get_info(self.device)[0]

    def _new_pool(self):
        return torch.cuda.graph_pool_handle()

    def _capture_graph(self, forward):
        """(graph, its output tensor) of forward() captured into self.pool."""
        dev = self.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # one eager run first: lazy inits and autotuning stay out of the graph
            forward()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()
        return graph, out

    # -- steps ----------------------------------------------------------------------------------
    def _shape(self, meta) -> tuple[int, int] | None:
        """(padded batch, q_len) of the graph that replays a step of this metadata, or None (eager:
        also when its block tables are wider than the static ones)."""
        shape = graph_shape(meta, self.sizes, self.static)
        return None if shape is None or meta.block_tables.shape[1] > self.width else shape

    def sibling(self, model, kv_caches, row_inputs=(), what: str = "cuda graphs") -> "CUDAGraphExecutor":
        """The same sizes and query lengths for another module (the MTP fill), captured into this
        executor's memory pool."""
        return type(self)(
            model,
            kv_caches,
            self.block_size,
            self.max_model_len,
            self.sizes[-1],
            self.query_lens,
            self.device,
            row_inputs=row_inputs,
            what=f"{what} cuda graphs",
            pool=self.pool,
        )

    def covers(self, meta) -> bool:
        """Whether a step of this metadata (and no RowSelection) replays a graph."""
        return self._shape(meta) is not None

    def run(self, input_ids, positions, meta, select=None, *rows):
        """rows: the model's per-row inputs (row_inputs), [T, ...] each."""
        shape = None if select is not None else self._shape(meta)
        if shape is None:
            return self.model(input_ids, positions, self.kv_caches, meta, select, *rows)
        batch, q = shape
        pad_decode(input_ids, positions, meta, batch, meta.block_tables.shape[1]).copy_into(self.static[q])
        T = input_ids.shape[0]
        for buf, r in zip(self.rows[q], rows):  # padding rows read zeros (their slots are -1, outputs dropped)
            buf[:T].copy_(r, non_blocking=True)
            buf[T : batch * q].zero_()
        graph, out = self.graphs[(q, batch)]
        graph.replay()
        take_decode_snapshots(meta, [c for c in self.kv_caches if not isinstance(c, torch.Tensor)])
        self.replays += 1
        return out[:T].clone()  # the next replay overwrites out


def graph_pool_estimate(
    model: torch.nn.Module,
    mc,
    max_batch: int,
    q_len: int,
    max_model_len: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> int:
    """Bytes the graphs' shared pool will take: the largest graph's forward run once eagerly (its
    activations; smaller graphs reuse that memory), plus 10%."""
    width = table_width(max_model_len, block_size)
    # one block: every table entry is block 0; a hybrid's linear-attention layers get one state slot,
    # which the step does not touch (its rows' state slots are -1)
    states = model.make_recurrent_states(1, device) if mc.is_hybrid else [None] * mc.num_layers
    caches = [
        st
        if st is not None
        else torch.zeros(2, 1, block_size, mc.num_kv_heads, mc.head_dim, dtype=dtype, device=device)
        for st in states
    ]
    x = warmup_inputs(max_batch, q_len, width, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        model(x.input_ids, x.positions, caches, fixed_meta(x, q_len, block_size))
    torch.cuda.synchronize(device)
    used = torch.cuda.max_memory_allocated(device) - base
    del caches, x
    torch.cuda.empty_cache()
    return int(used * 1.1)
