"""Argmax and small top-k over float32 logit rows on CPU, and a grammar's token bitmask applied to
chosen rows (cpu_row_top.cpp).

Why: every decode step picks the greedy tokens (argmax) of its [B, V] logits, and a quantized LM
head first finds each row's leading candidates (top-8) to recompute them in float32
(GGUFEmbeddingMethod.refine). torch's CPU argmax and topk take an element at a time: for the throughput bench's
[64, 49152] on 2 Zen4 threads argmax 2.70 -> 0.22 ms and top-8 3.06 -> 0.17 ms here, ~4% of a
64-row decode step (benchmarks/cpu.md, Levers). Never inside torch.compile (no fake kernels):
the compiled graphs keep torch's ops.

argmax() is torch.argmax(x, -1) exactly (first index of the max; a NaN counts as the max).
topk_indices() returns the k largest's indices, largest first, equal values in index order;
unlike torch.topk it never picks a NaN. mask_rows() sets the tokens a structured-output bitmask
forbids to -inf (xgrammar's apply_token_bitmask_inplace, ~25x faster on 49k-token rows). All fall back
to torch where the kernel does not apply (neither AVX-512 nor AVX2, not float32 2-D contiguous CPU rows,
inside torch.compile, or not built). One build per machine: AVX-512 (16 lanes) or AVX2 (8 lanes: Zen2/3,
Haswell on), the same loops; docs/tuning.md, "CPU kernels", has the AVX2 build's figures.
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build
from ember.kernels.tracing import tracing


def available() -> bool:
    """The ops can run here (AVX-512 or AVX2; loaded, built once first where they were not built at install)."""
    return build("cpu_row_top.cpp") is not None


def _applies(x: torch.Tensor) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[1] > 0
        and x.is_contiguous()
        and not tracing(x)
        and available()
    )


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of [n, V] rows, int64 [n]."""
    return torch.ops.ember_cpu.argmax_rows(x) if _applies(x) else x.argmax(dim=-1)


def topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [n, k] of each row's k largest values (k <= V), largest first."""
    if _applies(x):
        return torch.ops.ember_cpu.topk_rows(x, k)[1]
    return x.topk(k, dim=-1).indices


def mask_rows(x: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: x[rows[i], t] = -inf where bit t of bitmask[i] is 0 (int32 words, 32 tokens each, xgrammar's layout)."""
    if _applies(x) and bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu":
        torch.ops.ember_cpu.mask_rows(x, bitmask, torch.tensor(rows, dtype=torch.int64))
        return
    import xgrammar as xgr

    full = torch.full((x.shape[0], bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(x, full.to(x.device, non_blocking=True), vocab_size=x.shape[1], indices=list(rows))
