"""Attention layer: store this step's K/V in the layer's paged cache, then ask the backend.

kv_cache is [2, num_blocks, block_size, num_kv_heads, head_dim]; a token's slot is
block_id * block_size + offset. Slots < 0 (padding rows) are not written.
The cache must be created zeroed (torch.zeros): backends read whole blocks and mask the
unused tail, and uninitialised memory could hold NaN, which masking does not remove.
"""
from __future__ import annotations

import torch
from torch import nn

from ember.kernels.metadata import AttentionMetadata


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   all_valid: bool = False) -> None:
    """k, v [T, Hkv, D] -> kv_cache at slot_mapping (casts to the cache dtype)."""
    key_cache = kv_cache[0].view(-1, *kv_cache.shape[-2:])
    value_cache = kv_cache[1].view(-1, *kv_cache.shape[-2:])
    if all_valid:
        key_cache.index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        value_cache.index_copy_(0, slot_mapping, v.to(kv_cache.dtype))
        return
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    key_cache[slots] = k[valid].to(kv_cache.dtype)
    value_cache[slots] = v[valid].to(kv_cache.dtype)


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend, layer_idx: int = 0):
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.scale, self.backend, self.layer_idx = scale, backend, layer_idx

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] (after norm and RoPE) -> [T, Hq, D]."""
        write_kv_cache(k, v, kv_cache, meta.slot_mapping, meta.all_slots_valid)
        return self.backend.forward(q, k, v, kv_cache, meta, self.scale)
