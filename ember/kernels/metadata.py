"""AttentionMetadata: the one step shape every attention backend sees.

A step is a flat list of T query tokens from B sequences. Sequence b owns query tokens
query_start_loc[b]:query_start_loc[b+1] (q_len new tokens) and has seq_lens[b] tokens in the
cache after this step's K/V are written (ctx_len = seq_len - q_len already cached). Decodes
(q_len 1), prefill chunks (q_len many) and speculative verifies (q_len 1 + k) all look alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block_id * block_size + offset) per new token; -1 = skip
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    block_size: int
    # Host copies, so the CPU reference never syncs to read shapes.
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int
    # True when no slot is -1 (no padding rows): K/V writes skip the masking (a sync per layer).
    all_slots_valid: bool = False
    # Built by a StepExecutor for torch.compile / CUDA-graph capture (ember.engine.executor.decode_batch):
    # the host lists and max_seq_len are bounds, not this step's values; padding rows have slot -1.
    fixed_shape: bool = False
    # Hybrid models: each sequence's recurrent-state slot (see RecurrentMetadata); None otherwise.
    recurrent: "RecurrentMetadata | None" = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass
class RecurrentMetadata:
    """What a linear-attention (Gated DeltaNet) layer needs per sequence of the step, beside the
    attention layers' metadata: its slot in the state pool, whether it continues a state (tokens
    before this step) or starts from zero, and how many draft tokens it verifies (the layer then
    keeps the state after every token, and the runner commits the last accepted one); snapshots:
    (t, snapshot slot) pairs, "copy the state after t tokens of this step to that slot" (prefix
    caching; a verify's are written at commit, only for accepted tokens)."""

    slots: list[int]
    has_state: list[bool]
    num_drafts: list[int]
    snapshots: list[list[tuple[int, int]]]
    # index tensors built from the lists above by the first layer that needs them, shared by the rest
    _index_tensors: dict = field(default_factory=dict, repr=False, compare=False)
    # A fixed-shape decode step (compiled or captured, ember.engine.executor.decode_batch): the lists
    # are empty and these [B] tensors say it all: the slot each row's state is updated in, and the
    # slot it starts from (-1: zeros; padding rows have -1 in both). Its snapshots are taken by the
    # executor after the step.
    device_slots: torch.Tensor | None = None
    device_sources: torch.Tensor | None = None

    @classmethod
    def fixed(cls, slots: torch.Tensor, sources: torch.Tensor) -> "RecurrentMetadata":
        return cls([], [], [], [], device_slots=slots, device_sources=sources)

    def decode_snapshots(self) -> list[tuple[int, int]]:
        """(slot, snapshot slot) of a decode step: copy the state after its one token there."""
        return [(slot, snap) for slot, snaps in zip(self.slots, self.snapshots) for _, snap in snaps]

    def index_tensor(self, name: str, values, device) -> torch.Tensor:
        """values (computed by the caller's callable) as an int64 tensor on device, built once per step."""
        key = (name, str(device))
        if key not in self._index_tensors:
            self._index_tensors[key] = torch.tensor(values(), dtype=torch.int64, device=device)
        return self._index_tensors[key]


@dataclass
class RowSelection:
    """The rows whose hidden state is needed after the last layer (those that get logits:
    the last new token of a sequence, or every row of a speculative verify). The last layer still writes every row's K/V
    but runs attention, o_proj and the MLP only for these: a prefill of n tokens that samples
    once does 1 row of that work instead of n, and a mid-prompt chunk does none.

    meta: decode-shaped metadata for the selected rows: q_len 1 each, seq_len = the row's
    position + 1, its sequence's block table."""

    rows: torch.Tensor  # [R] int64 flat indices into the step's tokens
    meta: AttentionMetadata | None  # None when R == 0


def select_rows(
    meta: AttentionMetadata,
    tables: list[list[int]],
    positions: list[int],
    rows: list[int],
    seqs: list[int],
    device: torch.device,
) -> RowSelection:
    """rows (flat indices into the step) as decode-shaped queries: each attends to the keys up to
    its own position, through its sequence's (seqs[i]) block table."""
    if not rows:
        return RowSelection(torch.empty(0, dtype=torch.int64, device=device), None)
    # Each row attends to the keys up to its own position (a verify step's draft rows sit
    # inside their sequence; a last token's position + 1 is its sequence's length).
    seq_lens = [positions[r] + 1 for r in rows]
    row_t = torch.tensor(rows, dtype=torch.int64, device=device)
    sub = AttentionMetadata(
        slot_mapping=meta.slot_mapping[row_t],
        query_start_loc=torch.arange(len(rows) + 1, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([tables[b] for b in seqs], dtype=torch.int32, device=device),
        block_size=meta.block_size,
        query_lens_cpu=[1] * len(rows),
        seq_lens_cpu=seq_lens,
        max_query_len=1,
        max_seq_len=max(seq_lens),
        all_slots_valid=True,
    )
    return RowSelection(row_t, sub)
