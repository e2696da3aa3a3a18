"""TritonAttentionBackend: the GPU attention backend, same signature as the torch reference.

A step whose every sequence has q_len <= MAX_SPLIT_KV_QUERY_LEN (decodes, speculative verifies
of up to 8 draft tokens) goes to the split-KV decode kernel: its cost is reading the context,
which the splits spread over the GPU. Any step with a longer query (a prefill chunk, alone or
mixed with decodes) goes to the varlen prefill kernel, which tiles the queries instead.
Both read every key from the paged cache, so this step's k/v arguments are not used: the
backend's own store_kv (the Triton KV store kernel, which also quantizes for an fp8 cache)
has already written them (stores_kv: the Attention layer calls store_kv instead of writing).
"""

from __future__ import annotations

import torch

from ember.kernels.metadata import AttentionMetadata
from ember.kernels.triton_decode import paged_decode_attention
from ember.kernels.triton_kv_store import store_kv
from ember.kernels.triton_prefill import paged_prefill_attention

MAX_SPLIT_KV_QUERY_LEN = 1 + 8  # a verify of the most draft tokens ember proposes (--num-speculative-tokens <= 8)


class TritonAttentionBackend:
    name = "triton"
    stores_kv = True
    # Steps of up to this uniform q_len run from fixed-shape metadata (decode_batch.fixed_meta): the
    # split-KV kernel reads lengths from device tensors and sizes its grid from the bounds, so CUDA
    # graphs capture speculative verify steps (1 + k queries per sequence) as well as decodes.
    fixed_shape_max_query_len = MAX_SPLIT_KV_QUERY_LEN
    graph_devices = ("cuda",)  # CUDA graphs of decode and verify steps (on CPU it runs only interpreted)

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write k/v [T, Hkv, D] at slot_mapping (-1: skip); fp8(clamp(x / scale)) for an fp8 cache."""
        store_kv(k, v, kv_cache, slot_mapping, k_scale, v_scale)

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
        """q [T, Hq, D] -> [T, Hq, D]; k/v [T, Hkv, D] are already in kv_cache (unused here).

        k_scale / v_scale: fp32 scalars of an fp8 cache."""
        num_tokens = sum(meta.query_lens_cpu)
        # Rows past the last sequence (padding) are zero, as in the reference.
        out = torch.empty_like(q) if q.shape[0] == num_tokens else torch.zeros_like(q)
        if meta.max_query_len <= MAX_SPLIT_KV_QUERY_LEN:
            return paged_decode_attention(
                q,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                meta.max_query_len,
                meta.max_seq_len,
                num_tokens,
                scale,
                out,
                k_scale,
                v_scale,
            )
        return paged_prefill_attention(
            q,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            out,
            k_scale,
            v_scale,
        )
