"""QSA (qwen4_exp's indexed sparse attention): which tokens each query of an attention layer attends to.

An indexer projects each token to `num_heads` query heads and one raw key of `head_dim`. Raw keys are
cached per token in a paged pool beside the layer's KV (same slots: block_id * block_size + offset), so
prefix sharing, truncation and preemption treat them as they treat K/V. For a query at sequence index p
(text: its position), blocks are the token groups [r b, r b + r) counted from the sequence start; block b
is visible iff r b + r - 1 <= p. A block's key is RoPE(norm(mean of its r raw keys), position of its first
token); its score is sum_h ReLU(q_h . K_b) / sqrt(head_dim) in float32. The query attends to the tokens of
its top budget / r visible blocks and to the incomplete tail [r n_c, p] (n_c = (p + 1) // r): every visible
token while p + 1 <= budget + r - 1, so the selection is exactly dense below that (IndexerConfig.dense_below).
Block keys are pooled again from the raw keys at every step, so a block that rejected draft tokens once
completed is rebuilt from the accepted ones without bookkeeping.

Two forms of the selection. The reference (`select`, `masked_attention`): per sequence, a mask [n, N] over
its tokens and dense attention under it. The engine's (`select_blocks`, `selected_attention`): the whole
step at once in index form (BlockSelection: each query row's chosen block ids, its tail start and its
length), and attention that gathers only those tokens' K/V through the block table: the C++ kernel on CPU
(ember.kernels.cpu_qsa_attention), the Triton one on CUDA (ember.kernels.triton_qsa), else gathered
torch ops in row tiles; nothing of size [n, N] is built. Below the dense threshold the engine's attention
backend runs instead (ember.models.qwen4_exp).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from ember.config.model_config import IndexerConfig
from ember.kernels import cpu_qsa_attention, cpu_qsa_scoring
from ember.kernels.metadata import AttentionMetadata
from ember.layers.linear import ReplicatedLinear
from ember.layers.norm import ZeroCenteredRMSNorm
from ember.layers.rotary import apply_rotary

# a scoring tile's largest tensor (gathered block keys or scores), in elements: 32 MiB of float32
TILE_ELEMENTS = 1 << 23


@dataclass
class BlockSelection:
    """A step's selection in index form (what the kernels take). Query row i, of sequence seq_idx[i] (its
    block-table row) at sequence index kv_lens[i] - 1, attends to the `ratio` tokens of each block in
    blocks[i] (ascending ids, then -1 pads) and to its tail, tokens tail_start[i] .. kv_lens[i] - 1 (fewer
    than `ratio`). Every chosen block ends before the tail starts, so no token is counted twice."""

    blocks: torch.Tensor  # [T, K] int32
    tail_start: torch.Tensor  # [T] int32: ratio * (visible complete blocks)
    kv_lens: torch.Tensor  # [T] int32
    seq_idx: torch.Tensor  # [T] int32
    ratio: int

    def mask(self, length: int) -> torch.Tensor:
        """[T, length] bool: the mask form over sequence indices 0..length-1 (to compare with select)."""
        tokens = torch.arange(length, device=self.blocks.device)
        tail = (tokens[None, :] >= self.tail_start[:, None]) & (tokens[None, :] < self.kv_lens[:, None])
        return tail | (self.blocks[:, :, None] == (tokens // self.ratio)[None, None, :]).any(1)

    def token_lists(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [T, K * ratio + ratio - 1], valid): each row's attended sequence indices (0 where not valid)."""
        r = self.ratio
        steps = torch.arange(r, device=self.blocks.device)
        chosen = (self.blocks[:, :, None] * r + steps).flatten(1)
        tail = self.tail_start[:, None] + steps[: r - 1]
        tokens = torch.cat([chosen, tail], dim=1)
        valid = torch.cat([(self.blocks >= 0).repeat_interleave(r, dim=1), tail < self.kv_lens[:, None]], dim=1)
        return tokens.masked_fill(~valid, 0), valid


class QSAIndexer(nn.Module):
    def __init__(
        self, cfg: IndexerConfig, hidden: int, eps: float, dtype, device, quant_method=None, cpu_scoring: bool = False
    ):
        """cpu_scoring: select_blocks scores and ranks with the C++ kernel where it applies (CpuKernels.qsa_scoring)."""
        super().__init__()
        self.cfg, self.cpu_scoring = cfg, cpu_scoring
        d = cfg.head_dim
        self.index_qk_proj = ReplicatedLinear(
            hidden, (cfg.num_heads + 1) * d, dtype=dtype, device=device, quant_method=quant_method
        )
        self.q_layernorm = ZeroCenteredRMSNorm(d, eps, dtype, device)
        self.k_layernorm = ZeroCenteredRMSNorm(d, eps, dtype, device)
        self.keys: torch.Tensor | None = None  # [num_blocks * block_size, head_dim]: the paged raw keys

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta):
        """x [T, hidden] -> the queries [T, heads, head_dim] (normed, roped); writes the T raw keys at the
        step's slots (the pool is made on first use, with the KV cache's blocks)."""
        d, h = self.cfg.head_dim, self.cfg.num_heads
        qk = self.index_qk_proj(x)
        q, raw = qk.split([h * d, d], dim=-1)
        rows = kv_cache.shape[1] * kv_cache.shape[2]
        if self.keys is None or self.keys.shape[0] != rows:  # in the cache's dtype (the planner counts them so)
            dtype = x.dtype if kv_cache.dtype.itemsize == 1 else kv_cache.dtype
            self.keys = torch.zeros(rows, d, dtype=dtype, device=x.device)
        valid = meta.slot_mapping >= 0
        self.keys[meta.slot_mapping[valid]] = raw[valid].to(self.keys.dtype)
        q = self.q_layernorm(q.reshape(x.shape[0], h, d))
        return apply_rotary(q, cos, sin, False)

    def block_keys(self, raw: torch.Tensor, cos_sin) -> torch.Tensor:
        """raw [N, d] (a sequence's raw keys) -> its complete blocks' keys [N // r, d]."""
        r = self.cfg.compress_ratio
        nb = raw.shape[0] // r
        pooled = raw[: nb * r].view(nb, r, -1).float().mean(1).to(raw.dtype)
        cos, sin = cos_sin
        return apply_rotary(self.k_layernorm(pooled).unsqueeze(1), cos[: nb * r : r], sin[: nb * r : r], False)[:, 0]

    def select(self, q: torch.Tensor, raw: torch.Tensor, first: int, cos_sin) -> torch.Tensor:
        """The selection of one sequence's queries: q [n, heads, d] at sequence indices first..first+n-1,
        raw [N, d] its keys (N = first + n) -> mask [n, N] (True: attended; causal included)."""
        r, n, N = self.cfg.compress_ratio, q.shape[0], raw.shape[0]
        p = torch.arange(first, first + n, device=q.device)
        nc = (p + 1) // r  # each query's visible complete blocks
        tokens = torch.arange(N, device=q.device)
        mask = (tokens[None, :] >= (r * nc)[:, None]) & (tokens[None, :] <= p[:, None])  # the tail
        nb = N // r
        if nb == 0:
            return mask
        keys = self.block_keys(raw, cos_sin)
        scores = torch.relu(torch.einsum("nhd,bd->nhb", q.float(), keys.float())).sum(1) / math.sqrt(q.shape[-1])
        top = top_blocks(scores, nc, min(self.cfg.budget // r, nb)).to(torch.int64)
        chosen = torch.zeros(n, nb + 1, dtype=torch.bool, device=q.device)
        chosen.scatter_(1, top.masked_fill(top < 0, nb), True)  # pads mark the spare column
        mask[:, : nb * r] |= chosen[:, :nb].repeat_interleave(r, dim=1)
        return mask

    def select_blocks(self, q: torch.Tensor, meta: AttentionMetadata, cos_sin) -> BlockSelection:
        """select's choice for every query row of the step at once, in index form: q [T, heads, d] (the
        step's rows, sequence by sequence as meta lays them out), cos_sin of sequence indices 0..max_seq_len-1.
        Block keys are pooled for the whole batch ([B, nb, d], nb = the longest sequence's blocks); scores
        and top-k go in row tiles of at most TILE_ELEMENTS (a prefill chunk's tile reads its one sequence's
        keys, a tile of decodes gathers each row's)."""
        r, dev = self.cfg.compress_ratio, q.device
        seq_host, pos_host = query_rows(meta)
        T = seq_host.shape[0]
        seq_idx, p = seq_host.to(dev), pos_host.to(dev)
        nc = (p + 1) // r
        nb = max(meta.seq_lens_cpu) // r
        k = min(self.cfg.budget // r, nb)
        blocks = torch.full((T, k), -1, dtype=torch.int32, device=dev)
        if k > 0:
            keys = self.batch_block_keys(meta, nb, cos_sin)
            if self.cpu_scoring and cpu_qsa_scoring.supports(q, keys):  # the same selection, ties included
                return BlockSelection(
                    cpu_qsa_scoring.select_blocks(q, keys, seq_idx, nc, k),
                    (r * nc).int(),
                    (p + 1).int(),
                    seq_idx.int(),
                    r,
                )
            keys = keys.float()
            rows = max(1, TILE_ELEMENTS // (nb * max(q.shape[1], q.shape[2])))
            for a in range(0, T, rows):
                b = min(T, a + rows)
                one = int(seq_host[a]) if seq_host[a] == seq_host[b - 1] else None
                blocks[a:b] = self._top_blocks(q[a:b], keys, seq_idx[a:b], one, nc[a:b], k)
        return BlockSelection(blocks, (r * nc).int(), (p + 1).int(), seq_idx.int(), r)

    def batch_block_keys(
        self, meta: AttentionMetadata, nb: int, cos_sin, keys: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The first nb block keys of every sequence of the step, [B, nb, d], as block_keys makes them (blocks
        past a sequence's end hold whatever the table's padding points at: no query sees them). keys: the raw
        key pool to read (default: this indexer's; a compiled step's is handed to it, ember.layers.qsa_graph)."""
        r, bs, B = self.cfg.compress_ratio, meta.block_size, meta.num_seqs
        keys = self.keys if keys is None else keys
        tokens = torch.arange(nb * r, device=meta.block_tables.device)
        slots = meta.block_tables[:B, tokens // bs].to(torch.int64) * bs + tokens % bs
        raw = keys[slots.to(keys.device)]
        pooled = raw.view(B * nb, r, -1).float().mean(1).to(raw.dtype)
        cos, sin = (c[: nb * r : r].repeat(B, 1) for c in cos_sin)
        return apply_rotary(self.k_layernorm(pooled).unsqueeze(1), cos, sin, False)[:, 0].view(B, nb, -1)

    def _top_blocks(self, q, keys, seq, one: int | None, nc, k: int) -> torch.Tensor:
        """Rows q [R, heads, d] of sequences seq (all of sequence `one` when not None) -> their top-k visible
        blocks [R, k] int32, ascending, -1 past the row's nc visible ones (select's scores and ranking)."""
        if one is not None:
            scores = torch.einsum("nhd,bd->nhb", q.float(), keys[one])
        else:
            scores = torch.einsum("nhd,nbd->nhb", q.float(), keys[seq])
        return top_blocks(torch.relu(scores).sum(1) / math.sqrt(q.shape[-1]), nc, k)


def top_blocks(scores: torch.Tensor, nc: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, nb] (float32) and each row's visible blocks nc [R] (blocks 0..nc-1) -> [R, k] int32: the row's
    k highest-scoring visible blocks (every one where nc <= k), ascending ids, then -1 pads.

    Ties at the cut are broken as the reference breaks them: its one torch.topk per query over that query's
    visible blocks alone. The ReLU makes ties at 0 common (all of a block's head scores negative), and
    torch.topk's choice among equal values depends on the row's length, so a batched top-k over rows padded to
    the longest sequence's blocks would keep other tied blocks: those rows (boundary_ties) ask torch.topk
    the reference's question again. Ties above the cut change nothing: every tied block is kept."""
    nb = scores.shape[1]
    ids = torch.arange(nb, device=scores.device)
    visible = ids[None, :] < nc[:, None]
    s = scores.masked_fill(~visible, float("-inf"))
    chosen = torch.zeros_like(visible)
    chosen.scatter_(1, s.topk(k, dim=1).indices, True)
    chosen &= visible
    for i in boundary_ties(s, nc, k).tolist():
        chosen[i] = False
        chosen[i, s[i, : int(nc[i])].topk(k).indices] = True
    key = torch.where(chosen, nb - ids, 0).topk(k, dim=1).values  # the earliest chosen first
    return torch.where(key > 0, nb - key, -1).to(torch.int32)


def query_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, sequence index) of each of the step's query rows, host int64 tensors (no device sync)."""
    q_lens = torch.tensor(meta.query_lens_cpu, dtype=torch.int64)
    seq = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    first = torch.tensor(meta.seq_lens_cpu, dtype=torch.int64) - q_lens  # each sequence's first query's index
    starts = torch.cumsum(q_lens, 0) - q_lens
    return seq, first[seq] + torch.arange(seq.shape[0]) - starts[seq]


def boundary_ties(scores: torch.Tensor, nc: torch.Tensor, k: int) -> torch.Tensor:
    """The queries (rows of scores [n, nb], -inf past each one's nc visible blocks) whose k-th best visible
    block ties with the best one left out: the only ones whose kept set depends on how ties are broken."""
    if scores.shape[1] <= k:
        return torch.empty(0, dtype=torch.int64)
    best = scores.topk(k + 1, dim=1).values
    return ((nc > k) & (best[:, k - 1] == best[:, k])).nonzero().squeeze(1).cpu()


def sequence_slots(meta: AttentionMetadata, b: int, length: int) -> torch.Tensor:
    """The cache slots of sequence b's first `length` tokens (through its block table)."""
    bs = meta.block_size
    blocks = meta.block_tables[b, : -(-length // bs)].to(torch.int64)
    return (blocks[:, None] * bs + torch.arange(bs, device=blocks.device)[None, :]).reshape(-1)[:length]


def masked_attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k/v [N, Hkv, D], mask [n, N] -> [n, Hq, D] (GQA: query head i reads kv head i // (Hq / Hkv))."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    s = torch.einsum("nhd,Nhd->hnN", q.float(), k) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnN,Nhd->nhd", torch.softmax(s, dim=-1), v).to(q.dtype)


def selected_attention(q, kv_cache, block_tables, sel: BlockSelection, scale: float, cpu_kernel: bool) -> torch.Tensor:
    """q [T, Hq, D] (the step's rows) over the K/V their selection keeps -> [T, Hq, D] in q's dtype: the C++
    kernel on CPU where `cpu_kernel` (CpuKernels.qsa_attention) and it takes the shapes, the Triton kernel on
    CUDA, else gathered_attention."""
    if cpu_kernel and cpu_qsa_attention.supports(q, kv_cache):
        return cpu_qsa_attention.qsa_attention(
            q, kv_cache, block_tables, sel.seq_idx, sel.blocks, sel.tail_start, sel.kv_lens, sel.ratio, scale
        )
    if q.device.type == "cuda":
        from ember.kernels.triton_qsa import qsa_attention  # imports triton: CUDA runs only

        return qsa_attention(
            q, kv_cache, block_tables, sel.seq_idx, sel.blocks, sel.tail_start, sel.kv_lens, sel.ratio, scale
        )
    return gathered_attention(q, kv_cache, block_tables, sel, scale)


def gathered_attention(q, kv_cache, block_tables, sel: BlockSelection, scale: float) -> torch.Tensor:
    """The torch form of the kernels: per row tile, the selected tokens' K/V gathered through the block
    table ([R, L, Hkv, D], L = K * ratio + ratio - 1) and attended in float32."""
    _, _, bs, Hkv, D = kv_cache.shape
    T, Hq = q.shape[:2]
    keys, values = (kv_cache[i].reshape(-1, Hkv, D) for i in (0, 1))
    tokens, valid = sel.token_lists()
    out = torch.empty_like(q)
    rows = max(1, TILE_ELEMENTS // max(1, tokens.shape[1] * Hkv * D))
    for a in range(0, T, rows):
        b = min(T, a + rows)
        t = tokens[a:b].to(torch.int64)
        slots = block_tables[sel.seq_idx[a:b, None], t // bs].to(torch.int64) * bs + t % bs
        k, v = keys[slots].float(), values[slots].float()  # [R, L, Hkv, D]
        qg = q[a:b].float().view(b - a, Hkv, Hq // Hkv, D)
        s = torch.einsum("rhgd,rlhd->rhgl", qg, k) * scale
        s = s.masked_fill(~valid[a:b, None, None, :], float("-inf"))
        o = torch.einsum("rhgl,rlhd->rhgd", torch.softmax(s, dim=-1), v)
        out[a:b] = o.reshape(b - a, Hq, D).to(q.dtype)
    return out
