"""TorchAttentionBackend: the reference (and ground truth) over the varlen step shape, torch ops only.

Sequence b has q_len new query tokens at positions ctx_len..seq_len-1 and all seq_len keys
in the paged cache (this step's K/V are already written). The paths:
  - decodes (q_len 1): all of them at once -- gather every sequence's blocks into one padded
    [B, L] batch, mask keys >= seq_len, one SDPA call. Runs in float32: on CPU one query over
    2K keys is ~8x slower in bf16.
  - fresh prefill (ctx_len 0): the step's own k/v with is_causal; no gather.
  - a few queries over a cached prefix (a speculative verify, up to VERIFY_MAX_QUERIES): the n x G
    query heads of each kv head folded into one batch, as decode folds G.
  - a chunk over a cached prefix (chunked prefill): gather this sequence's keys, causal mask
    offset by ctx_len, float32.
GQA: decode folds the G query heads of a kv head into G "queries" ([B, Hkv, G, D]), so no
K/V repeat; the other paths use SDPA's enable_gqa.
FP8 cache (k_scale / v_scale given): k/v and the cache hold fp8 values with K ~= K8 * k_scale.
Every path reads those fp8 values (the fresh prefill too: the step's k/v arrive already
quantized) and folds the scales: q * k_scale against K8 gives q . K, and out * v_scale
undoes V's scale (softmax weights sum to 1). The casts fp8 -> bf16/fp16/fp32 are exact.

The C++ CPU kernels are a backend of their own built on these paths (cpu_attention.py); each
path here is a method so that it can take over where its kernel applies and fall back to this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.kernels.metadata import AttentionMetadata

VERIFY_MAX_QUERIES = 16  # up to here a chunk over a cached prefix (a speculative verify) folds its queries


class TorchAttentionBackend:
    name = "torch"
    stores_kv = False  # the Attention layer writes this step's K/V (write_kv_cache)
    # Longest uniform q_len it runs from fixed-shape metadata (AttentionMetadata.fixed_shape):
    # decodes read only device tensors and the max_seq_len bound; longer queries loop over host lists.
    fixed_shape_max_query_len = 1
    # the reference: kept as it is (captured, its decode reads the max_model_len bound of keys for
    # every sequence, each step: slower than eager for short sequences)
    graph_devices: tuple[str, ...] = ()

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (this step's, already in kv_cache) -> [T, Hq, D].

        k_scale / v_scale: fp32 scalars of an fp8 cache (k, v and kv_cache then hold fp8)."""
        if k_scale is None:
            return self._forward(q, k, v, kv_cache, meta, scale)
        out = self._forward((q.float() * k_scale).to(q.dtype), k, v, kv_cache, meta, scale)
        return (out.float() * v_scale).to(q.dtype)

    def _forward(self, q, k, v, kv_cache, meta, scale):
        B = meta.num_seqs
        if meta.is_pure_decode and q.shape[0] == B:
            return self.decodes(q, kv_cache, meta, scale)
        if B == 1 and q.shape[0] == meta.query_lens_cpu[0]:
            return self.sequence(q, k, v, kv_cache, meta, 0, scale)  # one sequence: no buffer to scatter into
        out = torch.zeros_like(q)  # rows past the last sequence (padding) stay zero
        starts, s = [], 0
        for n in meta.query_lens_cpu:
            starts.append(s)
            s += n
        done = self.batched(q, kv_cache, meta, starts, out, scale)
        for b in range(B):
            n = meta.query_lens_cpu[b]
            if b in done or n == 0:
                continue
            rows = slice(starts[b], starts[b] + n)
            kb, vb = (None, None) if k is None else (k[rows], v[rows])  # only a fresh prefill reads them
            out[rows] = self.sequence(q[rows], kb, vb, kv_cache, meta, b, scale)
        return out

    # -- the paths (a backend with kernels overrides the ones they serve) ------------------------
    def decodes(self, q, kv_cache, meta, scale) -> torch.Tensor:
        """A pure-decode step: one query per sequence."""
        return decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, meta.block_size, scale)

    def batched(self, q, kv_cache, meta, starts: list[int], out: torch.Tensor, scale) -> set[int]:
        """The sequences of a mixed step that run together (here its decodes) into `out`; returns them."""
        few = [b for b in range(meta.num_seqs) if meta.query_lens_cpu[b] == 1]
        if few:
            tok = torch.tensor([starts[b] for b in few], device=q.device)
            idx = torch.tensor(few, device=q.device)
            out[tok] = decode_attention(
                q[tok],
                kv_cache,
                meta.block_tables[idx],
                meta.seq_lens[idx],
                max(meta.seq_lens_cpu[b] for b in few),
                meta.block_size,
                scale,
            )
        return set(few)

    def sequence(self, q, k, v, kv_cache, meta, b: int, scale) -> torch.Tensor:
        """Sequence b's q_len queries on their own."""
        n, seq_len = q.shape[0], meta.seq_lens_cpu[b]
        if seq_len == n:
            return self.prefill(q, k, v, scale)
        if n <= VERIFY_MAX_QUERIES:
            return self.verify(q, kv_cache, meta, b, scale)
        return self.chunk(q, kv_cache, meta.block_tables[b], seq_len, meta.block_size, scale)

    def prefill(self, q, k, v, scale) -> torch.Tensor:
        return prefill_attention(q, k, v, scale)

    def verify(self, q, kv_cache, meta, b: int, scale) -> torch.Tensor:
        return verify_attention(q, kv_cache, meta.block_tables[b], meta.seq_lens_cpu[b], meta.block_size, scale)

    def chunk(self, q, kv_cache, block_table, seq_len: int, block_size: int, scale) -> torch.Tensor:
        return chunk_attention(q, kv_cache, block_table, seq_len, block_size, scale)


def decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] -> [B, Hq, D]; one batched SDPA, float32."""
    B, Hq, D = q.shape
    Hkv = kv_cache.shape[-2]
    nb = (max_seq_len + block_size - 1) // block_size
    bt = block_tables[:, :nb].flatten()
    # index_select, not kv[bt]: advanced indexing is ~7x slower on CPU. [B*nb, bs, Hkv, D] -> [B, Hkv, L, D]
    k = kv_cache[0].index_select(0, bt).view(B, nb * block_size, Hkv, D).transpose(1, 2).float()
    v = kv_cache[1].index_select(0, bt).view(B, nb * block_size, Hkv, D).transpose(1, 2).float()
    mask = torch.arange(nb * block_size, device=q.device)[None, :] < seq_lens[:, None]
    qf = q.float().view(B, Hkv, Hq // Hkv, D)
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask[:, None, None, :], scale=scale)
    return o.reshape(B, Hq, D).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """A whole prompt with nothing cached before it: causal SDPA on the fresh k/v.

    4-D inputs on purpose: on CPU, 3-D SDPA misses the flash kernel (~7x slower at 2K tokens).
    """
    k, v = k.to(q.dtype), v.to(q.dtype)  # fp8 k/v (an fp8 cache) widen exactly
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        is_causal=True,
        scale=scale,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


def verify_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int, scale: float
) -> torch.Tensor:
    """chunk_attention for a few queries (a verify of 1 + k tokens): the n x G query heads of each kv
    head are folded into one [Hkv, n*G, D] batch, as decode_attention folds G, so SDPA never repeats
    K/V for GQA; query j sees keys < seq_len - n + j + 1. q [n, Hq, D] -> [n, Hq, D], float32."""
    n, Hq, D = q.shape
    Hkv = kv_cache.shape[-2]
    G = Hq // Hkv
    nb = (seq_len + block_size - 1) // block_size
    bt = block_table[:nb]
    k = kv_cache[0].index_select(0, bt).view(1, nb * block_size, Hkv, D).transpose(1, 2).float()
    v = kv_cache[1].index_select(0, bt).view(1, nb * block_size, Hkv, D).transpose(1, 2).float()
    qf = q.float().view(n, Hkv, G, D).permute(1, 0, 2, 3).reshape(1, Hkv, n * G, D)
    visible = torch.arange(seq_len - n + 1, seq_len + 1, device=q.device).repeat_interleave(G)  # [n*G]
    mask = torch.arange(nb * block_size, device=q.device)[None, :] < visible[:, None]
    o = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask[None, None], scale=scale)
    return o.view(Hkv, n, G, D).permute(1, 0, 2, 3).reshape(n, Hq, D).to(q.dtype)


def gather_keys(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int):
    """(k, v) [seq_len, Hkv, D] of one sequence, gathered from its blocks in the cache's dtype."""
    bt = block_table[: (seq_len + block_size - 1) // block_size]
    return (
        kv_cache[0].index_select(0, bt).flatten(0, 1)[:seq_len],
        kv_cache[1].index_select(0, bt).flatten(0, 1)[:seq_len],
    )


def chunk_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int, scale: float
) -> torch.Tensor:
    """q_len queries at positions seq_len-q_len..seq_len-1 over all seq_len cached keys."""
    n = q.shape[0]
    k, v = gather_keys(kv_cache, block_table, seq_len, block_size)
    k, v = k.transpose(0, 1).float(), v.transpose(0, 1).float()  # [Hkv, S, D]
    ctx = seq_len - n
    pos_q = torch.arange(ctx, seq_len, device=q.device)
    mask = torch.arange(seq_len, device=q.device)[None, :] <= pos_q[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).float()[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )  # 4-D: see prefill_attention
    return o[0].transpose(0, 1).to(q.dtype)
