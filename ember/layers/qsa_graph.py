"""QSA in a fixed-shape step (a compiled or exported decode graph: ember.engine.executor.decode_batch).

An eager step picks between the engine's dense attention (every sequence within the dense threshold) and
the selection from its host lists (query_rows, the longest sequence's block count). A fixed-shape step has
bounds in its host lists, so it always runs the selection in index form (ember.layers.qsa), every size
from its shapes and every length from the device seq_lens; below the threshold the selection keeps every
visible token, which is the dense answer:
- each query row's sequence index p = seq_lens[b] - n + j (row j of sequence b's n);
- block keys pooled for every sequence's first nb blocks, nb = the table's bound / ratio (blocks past a
  sequence's end are invisible to its rows, so they change nothing);
- the top budget / ratio visible blocks, [T, budget / ratio] with -1 pads, ties at the cut broken as the
  reference breaks them (torch.topk over the row's own visible blocks), which is each row's own work, so a
  graph holds it as one op of a fixed output shape: the C++ scoring kernel (kernels/cpu_qsa_scoring, where
  QSAIndexer.cpu_scoring), else `ember::qsa_top_blocks` over the scores (qsa.top_blocks: the ties' few rows
  are picked on the host; on CPU that is no sync);
- the raw keys written with no data-dependent shape (a padding row rewrites row 0's key at row 0's slot,
  as write_kv_cache_fixed does), into the key pool the step is handed (CompiledExecutor's graph pools).
"""

from __future__ import annotations

import math

import torch

from ember.kernels import cpu_qsa_scoring
from ember.kernels.metadata import AttentionMetadata
from ember.layers.qsa import BlockSelection, QSAIndexer, top_blocks
from ember.layers.rotary import apply_rotary


def index_queries(indexer: QSAIndexer, x, cos, sin, keys: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """QSAIndexer.forward in a fixed-shape step: x [T, hidden] -> the queries [T, heads, head_dim]; the T raw
    keys written into keys [pool rows, head_dim] at slot_mapping (-1: a padding row)."""
    d, h = indexer.cfg.head_dim, indexer.cfg.num_heads
    q, raw = indexer.index_qk_proj(x).split([h * d, d], dim=-1)
    valid = slot_mapping >= 0
    slots = torch.where(valid, slot_mapping, slot_mapping[:1])
    keys.index_put_((slots,), torch.where(valid[:, None], raw, raw[:1]).to(keys.dtype))
    q = indexer.q_layernorm(q.reshape(x.shape[0], h, d))
    return apply_rotary(q, cos, sin, False)


def query_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, sequence index) of each query row of a fixed-shape step, device int64 [T]: rows come
    sequence by sequence, max_query_len each, the last one at seq_lens - 1."""
    B, n = meta.block_tables.shape[0], meta.max_query_len
    rows = torch.arange(B * n, device=meta.seq_lens.device)
    seq = rows // n
    return seq, meta.seq_lens.to(torch.int64)[seq] - n + rows % n


def select_blocks(indexer: QSAIndexer, q: torch.Tensor, keys: torch.Tensor, meta: AttentionMetadata, cos_sin):
    """QSAIndexer.select_blocks in a fixed-shape step: q [T, heads, d] -> BlockSelection with [T, budget / ratio]
    blocks (the module docstring)."""
    r, k = indexer.cfg.compress_ratio, indexer.cfg.budget // indexer.cfg.compress_ratio
    seq, p = query_rows(meta)
    nc = (p + 1) // r
    nb = meta.max_seq_len // r
    block_keys = indexer.batch_block_keys(meta, nb, cos_sin, keys)  # [B, nb, d]
    if indexer.cpu_scoring and cpu_qsa_scoring.supports(q, block_keys):
        blocks = cpu_qsa_scoring.select_blocks(q, block_keys, seq, nc, k)
    else:
        scores = torch.einsum("nhd,nbd->nhb", q.float(), block_keys.float()[seq])
        scores = torch.relu(scores).sum(1) / math.sqrt(q.shape[-1])
        blocks = torch.ops.ember.qsa_top_blocks(scores, nc, k)
    return BlockSelection(blocks, (r * nc).int(), (p + 1).int(), seq.int(), r)


@torch.library.custom_op("ember::qsa_top_blocks", mutates_args=())
def qsa_top_blocks(scores: torch.Tensor, nc: torch.Tensor, k: int) -> torch.Tensor:
    """qsa.top_blocks at a fixed width: scores [R, nb], visible blocks nc [R] -> [R, k] int32, ascending ids,
    then -1 pads (k may exceed nb: short sequences)."""
    if scores.shape[1] == 0:
        return torch.full((scores.shape[0], k), -1, dtype=torch.int32, device=scores.device)
    top = top_blocks(scores, nc, min(k, scores.shape[1]))
    return torch.nn.functional.pad(top, (0, k - top.shape[1]), value=-1)


@qsa_top_blocks.register_fake
def _(scores: torch.Tensor, nc: torch.Tensor, k: int) -> torch.Tensor:
    return scores.new_empty((scores.shape[0], k), dtype=torch.int32)


def key_pool(indexer: QSAIndexer, kv_cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The indexer's raw key pool for kv_cache's blocks, made now where no step has made it yet (as
    QSAIndexer.forward makes it): what a compiled step is handed and writes."""
    rows = kv_cache.shape[1] * kv_cache.shape[2]
    if indexer.keys is None or indexer.keys.shape[0] != rows:
        keys_dtype = dtype if kv_cache.dtype.itemsize == 1 else kv_cache.dtype
        indexer.keys = torch.zeros(rows, indexer.cfg.head_dim, dtype=keys_dtype, device=kv_cache.device)
    return indexer.keys
