"""Block-scaled fp8 weights (Qwen's / DeepSeek's FP8 checkpoints): the scale grid, its rows, the reference.

A checkpoint's quantized matrix W [N, K] is `weight` float8_e4m3fn [N, K] and `weight_scale_inv` float32
[ceil(N / bn), ceil(K / bk)] for its `weight_block_size` [bn, bk]: W[n, k] = weight[n, k] *
scale_inv[n // bn, k // bk] (edge blocks partial). ember fuses matrices (q | k | v, gate | up, a
checkpoint's in_proj_qkv split into q, k, v and joined to z) whose parts need not start on a block
boundary, so a fused layer's scales cannot be one grid sliced by block rows. Instead:

- while loading, each scale arrives expanded to one row per weight row ([N, KB], `expand_rows`), so it
  follows its weight rows through every split, fuse and tensor-parallel narrowing the loaders do;
- after loading, the rows are folded back (`fold_rows`): runs of equal rows become one row of a grid
  [B, KB], and `scale_row` int32 [N] says which grid row each weight row reads. B is the number of
  block rows the parts hold (a part that starts mid-block adds one), so the kept scales are the
  checkpoint's own, and the kernels index them by scale_row.

The input dim (K) is never fused, so its blocks stay the checkpoint's; a row-parallel split of K must
fall on a block boundary (checked where the layer is built: ember.quant.fp8_linear).
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def blocks(n: int, b: int) -> int:
    return -(-n // b)


def expand_rows(scale: torch.Tensor, rows: int, block_n: int) -> torch.Tensor:
    """[ceil(rows / block_n), KB] (leading dims allowed) -> float32 [rows, KB]: each weight row's scales."""
    return scale.float().repeat_interleave(block_n, dim=-2).narrow(-2, 0, rows).contiguous()


def fold_rows(row_scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scales [N, KB] -> (the distinct consecutive rows [B, KB], scale_row int32 [N]): exact, since a
    folded row equals every row it stands for."""
    N = row_scales.shape[0]
    if N == 0:
        return row_scales, torch.zeros(0, dtype=torch.int32)
    starts = torch.ones(N, dtype=torch.bool)
    starts[1:] = (row_scales[1:] != row_scales[:-1]).any(dim=1)
    scale_row = (torch.cumsum(starts.to(torch.int32), 0) - 1).to(torch.int32)
    return row_scales[starts].contiguous(), scale_row


def dequantize(
    weight: torch.Tensor, scale: torch.Tensor, scale_row: torch.Tensor, block_k: int, dtype=torch.float32
) -> torch.Tensor:
    """The reference: weight [N, K] as float32 times each element's block scale -> [N, K] in dtype."""
    K = weight.shape[-1]
    per_row = scale.float()[scale_row.long()]  # [N, KB]
    per_elem = per_row.repeat_interleave(block_k, dim=-1)[:, :K]
    return (weight.float() * per_elem).to(dtype)


def dequantize_checkpoint(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A checkpoint's (weight, weight_scale_inv) pair [.., N, K] -> float32 [.., N, K] (a module ember keeps dense)."""
    N, K = weight.shape[-2:]
    per_elem = expand_rows(scale_inv, N, block[0]).repeat_interleave(block[1], dim=-1)[..., :K]
    return weight.float() * per_elem


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [.., N, K] -> (float8_e4m3fn [.., N, K], weight_scale_inv float32 [.., ceil(N/bn), ceil(K/bk)]) as
    Qwen's FP8 exports make them: each block's absmax maps to 448 (an all-zero block gets scale 1)."""
    bn, bk = block
    N, K = w.shape[-2:]
    NB, KB = blocks(N, bn), blocks(K, bk)
    padded = torch.zeros(*w.shape[:-2], NB * bn, KB * bk, dtype=torch.float32)
    padded[..., :N, :K] = w.float()
    tiles = padded.unflatten(-1, (KB, bk)).unflatten(-3, (NB, bn))  # [.., NB, bn, KB, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [.., NB, KB]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(-2).flatten(-3, -2)[..., :N, :K].contiguous(), scale_inv.float()
