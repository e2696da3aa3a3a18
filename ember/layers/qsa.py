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

This module is the torch form (the reference for kernels to come): per sequence, the selection as a mask
over its tokens and the attention with that mask and the causal one. Below the dense threshold the
engine's attention backend runs instead (ember.models.qwen4_exp).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ember.config.model_config import IndexerConfig
from ember.kernels.metadata import AttentionMetadata
from ember.layers.linear import ReplicatedLinear
from ember.layers.norm import ZeroCenteredRMSNorm
from ember.layers.rotary import apply_rotary


class QSAIndexer(nn.Module):
    def __init__(self, cfg: IndexerConfig, hidden: int, eps: float, dtype, device, quant_method=None):
        super().__init__()
        self.cfg = cfg
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
        visible = torch.arange(nb, device=q.device)[None, :] < nc[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.cfg.budget // r, nb)
        top = scores.topk(k, dim=1).indices  # visible blocks first: their scores are finite
        chosen = torch.zeros(n, nb, dtype=torch.bool, device=q.device)
        chosen.scatter_(1, top, torch.arange(k, device=q.device)[None, :] < nc[:, None])
        for i in boundary_ties(scores, nc, k).tolist():
            # equal scores across the cut (ReLU makes every all-negative block exactly 0): which of them the
            # reference keeps is torch.topk's choice over that query's visible blocks alone, so ask it that
            chosen[i] = False
            chosen[i, scores[i, : nc[i]].topk(k).indices] = True
        mask[:, : nb * r] |= chosen.repeat_interleave(r, dim=1)
        return mask


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
