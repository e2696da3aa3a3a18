"""Decode-shaped batches at fixed shapes: the plain functions behind the compiled and CUDA-graph executors.

A compiled graph or a captured CUDA graph is only valid for the shapes it was built with, so a
step is run there only when it is *uniform decode*: every sequence has the same q_len (1, or
1 + k for a speculative verify with k drafts each) and no RowSelection. Its B sequences are
padded to the next size in `sizes` (bucket_for), and the block tables to a fixed width:

  - padding rows: input id 0, position 0, slot -1 (write_kv_cache skips them), seq_len q_len and
    an all-zero block table, i.e. they "attend" to finite cached keys and touch nothing real;
  - a hybrid model's recurrent-state slots ride along as two [B] tensors: state_slots (where each
    sequence's state is updated in place) and state_sources (the slot it starts from: -1 for a
    sequence with no state yet, which starts from zeros). Padding rows have -1 in both, so the
    Gated DeltaNet kernels neither read nor write a slot for them (dense models carry -1s too);
  - AttentionMetadata.fixed_shape = True: the host lists hold bounds, not per-step values
    (seq_lens_cpu = [max_seq_len] * B, max_seq_len = table width x block_size), so a backend under
    capture reads only the device tensors slot_mapping, query_start_loc, seq_lens, block_tables
    and the python ints max_query_len / max_seq_len. Anything that needs the real lengths reads
    seq_lens (device).

Everything here is ordinary tensor code, so it is unit-tested on CPU; the executors only add
torch.compile or CUDA-graph capture around it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ember.kernels.metadata import AttentionMetadata, RecurrentMetadata


def default_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch (vLLM's capture list shape), and max_batch itself."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8)) + [max_batch]
    return sorted(set(sizes))


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """Smallest size >= n, or None when n is larger than every size (the step runs eagerly)."""
    for s in sorted(sizes):
        if s >= n:
            return s
    return None


def uniform_query_len(meta: AttentionMetadata) -> int | None:
    """q_len when every sequence of the step has the same one, else None (host lists: no sync)."""
    q = meta.query_lens_cpu
    return q[0] if q and all(n == q[0] for n in q) else None


def table_width(max_seq_len: int, block_size: int, min_width: int = 2) -> int:
    """Blocks per row of a padded table. At least 2: torch.compile specialises a dynamic size 1."""
    return max(min_width, -(-max_seq_len // block_size))


@dataclass
class DecodeInputs:
    """The device tensors of one uniform-decode step, B sequences of q_len tokens each (T = B * q_len)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64, -1 = padding
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, W] int32
    state_slots: torch.Tensor  # [B] int64, -1 = padding (or a model without recurrent state)
    state_sources: torch.Tensor  # [B] int64, -1 = starts from zeros (a new sequence, padding)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def copy_into(self, static: "DecodeInputs") -> None:
        """Write these values into static's leading rows (CUDA graphs replay on fixed addresses).
        Only the leading block-table columns are written: columns past a sequence's length are
        never read unmasked, whatever stale block ids they hold."""
        for f in fields(self):
            src, dst = getattr(self, f.name), getattr(static, f.name)
            if src.dim() == 2:
                dst[: src.shape[0], : src.shape[1]].copy_(src, non_blocking=True)
            else:
                dst[: src.shape[0]].copy_(src, non_blocking=True)


def graph_shape(meta: AttentionMetadata, sizes: list[int], query_lens) -> tuple[int, int] | None:
    """(padded batch, q_len) of the graph (compiled or captured) that runs a uniform step of this
    metadata, or None when its q_len has no graph or its batch is above every size (eager)."""
    q = uniform_query_len(meta)
    batch = bucket_for(meta.num_seqs, sizes) if q in query_lens else None
    return None if batch is None else (batch, q)


def pad_decode(
    input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, batch: int, width: int
) -> DecodeInputs:
    """A uniform-decode step (B sequences of q_len rows) padded to `batch` sequences and block
    tables `width` wide. Padding is appended on the device: no host sync."""
    B, q_len = meta.num_seqs, meta.max_query_len
    pad = batch - B
    assert pad >= 0 and uniform_query_len(meta) == q_len, (B, batch, meta.query_lens_cpu)
    dev = input_ids.device
    tables = meta.block_tables
    if tables.shape[1] < width:
        tables = torch.nn.functional.pad(tables, (0, width - tables.shape[1]))
    tables = tables[:, :width]
    if pad:
        zeros = torch.zeros(pad * q_len, dtype=torch.int64, device=dev)
        input_ids = torch.cat([input_ids, zeros])
        positions = torch.cat([positions, zeros])
        slot_mapping = torch.cat([meta.slot_mapping, torch.full_like(zeros, -1)])
        seq_lens = torch.cat([meta.seq_lens, torch.full((pad,), q_len, dtype=meta.seq_lens.dtype, device=dev)])
        tables = torch.cat([tables, torch.zeros(pad, width, dtype=tables.dtype, device=dev)])
    else:
        slot_mapping, seq_lens = meta.slot_mapping, meta.seq_lens
    qsl = torch.arange(batch + 1, dtype=torch.int32, device=dev) * q_len
    state_slots, state_sources = _state_indices(meta, batch, dev)
    return DecodeInputs(
        input_ids, positions, slot_mapping, qsl, seq_lens, tables.contiguous(), state_slots, state_sources
    )


def _state_indices(meta: AttentionMetadata, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(state_slots, state_sources) [batch] from the step's recurrent metadata, padded with -1."""
    rec, pad = meta.recurrent, batch - meta.num_seqs
    if rec is None:
        return (torch.full((batch,), -1, dtype=torch.int64, device=device),) * 2
    slots = rec.slots + [-1] * pad
    sources = [s if has else -1 for s, has in zip(rec.slots, rec.has_state)] + [-1] * pad
    return (
        torch.tensor(slots, dtype=torch.int64, device=device),
        torch.tensor(sources, dtype=torch.int64, device=device),
    )


def fixed_meta(inputs: DecodeInputs, q_len: int, block_size: int) -> AttentionMetadata:
    """AttentionMetadata over fixed-shape inputs: host lists hold bounds (see the module docstring).
    Python ints come from shapes only, so the same code works traced (torch.compile) and captured."""
    B, W = inputs.block_tables.shape
    bound = W * block_size
    return AttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        query_start_loc=inputs.query_start_loc,
        seq_lens=inputs.seq_lens,
        block_tables=inputs.block_tables,
        block_size=block_size,
        query_lens_cpu=[q_len] * B,
        seq_lens_cpu=[bound] * B,
        max_query_len=q_len,
        max_seq_len=bound,
        all_slots_valid=False,
        fixed_shape=True,
        recurrent=RecurrentMetadata.fixed(inputs.state_slots, inputs.state_sources),
    )


def static_buffers(max_batch: int, q_len: int, width: int, device: torch.device) -> DecodeInputs:
    """Zeroed buffers for the largest captured batch; smaller graphs use their leading rows."""
    T = max_batch * q_len
    return DecodeInputs(
        input_ids=torch.zeros(T, dtype=torch.int64, device=device),
        positions=torch.zeros(T, dtype=torch.int64, device=device),
        slot_mapping=torch.full((T,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device) * q_len,
        seq_lens=torch.full((max_batch,), q_len, dtype=torch.int32, device=device),
        block_tables=torch.zeros(max_batch, width, dtype=torch.int32, device=device),
        state_slots=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
        state_sources=torch.full((max_batch,), -1, dtype=torch.int64, device=device),
    )


def leading(static: DecodeInputs, batch: int, q_len: int) -> DecodeInputs:
    """Views of the first `batch` sequences of static buffers (what a graph of that size reads)."""
    T = batch * q_len
    return DecodeInputs(
        static.input_ids[:T],
        static.positions[:T],
        static.slot_mapping[:T],
        static.query_start_loc[: batch + 1],
        static.seq_lens[:batch],
        static.block_tables[:batch],
        static.state_slots[:batch],
        static.state_sources[:batch],
    )


def warmup_inputs(batch: int, q_len: int, width: int, device: torch.device) -> DecodeInputs:
    """A dummy step for compiling or capturing: row 0 writes slot 0 (block 0, which the caller
    re-zeroes afterwards), every other row is padding. No recurrent-state slot is read or written."""
    x = static_buffers(batch, q_len, width, device)
    x.slot_mapping[0] = 0
    return x


def take_decode_snapshots(meta: AttentionMetadata, states: list) -> None:
    """After a fixed-shape step of a hybrid model: the prefix-cache snapshots its decodes asked for
    (meta: the step's own metadata, with its lists), copied slot to slot in every linear-attention
    layer's RecurrentState. An eager step's layers take them themselves; a graph cannot, since which
    sequences snapshot changes from step to step."""
    if meta.recurrent is None or not states:
        return
    for slot, snap in meta.recurrent.decode_snapshots():
        for state in states:
            state.copy(slot, snap)
