"""The attention backend contract: what the Attention layer and the step executors may rely on.

A backend sees one step shape (AttentionMetadata: each sequence has q_len new tokens and ctx_len
cached ones in its blocks) and returns the attention output of every query row. Its capabilities
are declared fields, read by name (never probed with getattr):

  stores_kv                  True: the backend writes this step's K/V into the cache itself
                             (store_kv, quantizing for an fp8 cache) and forward reads them back;
                             False: the Attention layer writes them first (write_kv_cache).
  fixed_shape_max_query_len  the longest uniform q_len it runs from fixed-shape metadata
                             (AttentionMetadata.fixed_shape: host lists are bounds, lengths live in
                             device tensors): what CUDA graphs and compiled CPU graphs may capture.

Backends: torch (the reference), cpu (the reference with C++ kernels), triton (GPU); see
ember.kernels.get_attention_backend.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ember.kernels.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str
    stores_kv: bool
    fixed_shape_max_query_len: int
    graph_devices: tuple[str, ...]
    """Device types on which its decode step belongs in a graph (--executor auto builds one: compiled on
    CPU, captured on CUDA); none for the torch reference, whose captured decode would read the
    max_model_len bound of keys each step."""

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
        """q [T, Hq, D], k/v [T, Hkv, D] (this step's) -> [T, Hq, D]; rows past the last sequence are 0.
        k_scale / v_scale: the fp32 scalars of an fp8 cache."""
        ...

    def store_kv(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Write k/v [T, Hkv, D] at slot_mapping (-1: skip). Called only where stores_kv."""
        ...


def fixed_shape_query_lens(k_max: int, backend: AttentionBackend | None, every_k: bool = False) -> list[int]:
    """Query lengths a graph executor builds for: 1 (decode), and 1 + k when speculating with k drafts
    and the backend runs that from fixed-shape metadata; with every_k (adaptive k, compiled CPU
    graphs), every 1 + j for j in 1..k_max."""
    bound = backend.fixed_shape_max_query_len if backend is not None else 1
    if k_max >= 1 and bound >= 1 + k_max:
        return list(range(1, k_max + 2)) if every_k else [1, 1 + k_max]
    return [1]
