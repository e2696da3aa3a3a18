"""CpuAttentionBackend: the torch reference with ember's C++ CPU kernels where they apply.

  - decodes, verifies and short prompts (up to VERIFY_MAX_QUERIES queries a sequence) go to the
    fused paged attention kernel (cpu_paged_attention.py: no gather, ~5x the reference's decode
    path at 64 sequences), all such sequences of a step in one call, when `fused_decode` (the
    --cpu-paged-attention switch) and the kernel is built and takes the shapes;
  - with it, uniform verifies of up to VERIFY_MAX_QUERIES queries also run from fixed-shape
    metadata (the compiled CPU executor's speculative verify graphs): the per-query key counts
    come from the device seq_lens (query j of n sees seq_len - n + 1 + j keys);
  - bf16 and float32 prefills and prefill chunks go to the flash-style causal kernel
    (cpu_causal_attention.py: bf16 on AVX512-BF16, float32 on AVX2 + FMA or AVX-512) when `flash`
    (--cpu-flash-attention), else, for bf16 from 128 queries on, to blocked bf16 GEMMs (faster than
    SDPA there), else to the reference's SDPA.
Everything else, and every case a kernel does not take, is the reference's path.
"""

from __future__ import annotations

import torch

from ember.kernels.cpu_causal_attention import attention_path, causal_attention
from ember.kernels.cpu_paged_attention import paged_attention
from ember.kernels.cpu_paged_attention import supports as fused_supports
from ember.kernels.torch_attention import VERIFY_MAX_QUERIES, TorchAttentionBackend, gather_keys


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"
    graph_devices = ("cpu",)  # torch.compile'd decode steps over its C++ kernels

    def __init__(self, fused_decode: bool = True, flash: bool = True):
        self.fused_decode = fused_decode
        self.flash = flash

    @property
    def fixed_shape_max_query_len(self) -> int:
        return VERIFY_MAX_QUERIES if self.fused_decode else 1

    def _fused(self, q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
        return self.fused_decode and fused_supports(q, kv_cache)

    def _forward(self, q, k, v, kv_cache, meta, scale):
        if meta.fixed_shape and meta.max_query_len > 1 and self._fused(q, kv_cache):
            # Uniform verify of n queries per sequence: the host lists hold bounds, so the kernel's
            # per-query key counts come from the device seq_lens (query j sees seq_len - n + 1 + j).
            B, n = meta.num_seqs, meta.max_query_len
            seq_idx = torch.arange(B, dtype=torch.int32).repeat_interleave(n)
            kv_lens = (meta.seq_lens[:B, None] - (n - 1) + torch.arange(n, dtype=torch.int32)).reshape(-1)
            return paged_attention(q, kv_cache, meta.block_tables, seq_idx, kv_lens, scale)
        return super()._forward(q, k, v, kv_cache, meta, scale)

    def decodes(self, q, kv_cache, meta, scale):
        if self._fused(q, kv_cache):
            B = meta.num_seqs
            return paged_attention(
                q, kv_cache, meta.block_tables, torch.arange(B, dtype=torch.int32), meta.seq_lens[:B], scale
            )
        return super().decodes(q, kv_cache, meta, scale)

    def batched(self, q, kv_cache, meta, starts, out, scale):
        if not self._fused(q, kv_cache):
            return super().batched(q, kv_cache, meta, starts, out, scale)
        # every sequence with few queries (decodes, verifies, short prompts) in one call
        few = [b for b in range(meta.num_seqs) if 1 <= meta.query_lens_cpu[b] <= VERIFY_MAX_QUERIES]
        if few:
            rows = torch.tensor([starts[b] + j for b in few for j in range(meta.query_lens_cpu[b])])
            out[rows] = self._fused_few(q[rows], kv_cache, meta, few, scale)
        return set(few)

    def verify(self, q, kv_cache, meta, b, scale):
        if self._fused(q, kv_cache):
            return self._fused_few(q, kv_cache, meta, [b], scale)
        return super().verify(q, kv_cache, meta, b, scale)

    def prefill(self, q, k, v, scale):
        out = causal_attention(q, k, v, scale, flash=self.flash)
        return out if out is not None else super().prefill(q, k, v, scale)

    def chunk(self, q, kv_cache, block_table, seq_len, block_size, scale):
        if attention_path(q, seq_len, self.flash) is not None:  # else the reference's path, with its own gather
            return causal_attention(
                q, *gather_keys(kv_cache, block_table, seq_len, block_size), scale, flash=self.flash
            )
        return super().chunk(q, kv_cache, block_table, seq_len, block_size, scale)

    @staticmethod
    def _fused_few(q, kv_cache, meta, seqs: list[int], scale: float) -> torch.Tensor:
        """The C++ kernel over sequences `seqs`, each with q_len queries at its end; query j of a
        sequence with n queries and seq_len keys sees seq_len - n + 1 + j of them."""
        seq_idx, kv_lens = [], []
        for b in seqs:
            n, seq_len = meta.query_lens_cpu[b], meta.seq_lens_cpu[b]
            seq_idx += [b] * n
            kv_lens += range(seq_len - n + 1, seq_len + 1)
        return paged_attention(
            q,
            kv_cache,
            meta.block_tables,
            torch.tensor(seq_idx, dtype=torch.int32),
            torch.tensor(kv_lens, dtype=torch.int32),
            scale,
        )
