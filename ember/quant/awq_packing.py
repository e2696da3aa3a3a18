"""AutoAWQ "GEMM" tensors: group-wise asymmetric int4, packed 8 per int32 along the output dim
with AWQ's interleaved nibble order (formats.md §1.3-1.4).

Layout for a Linear with weight W [out, in] and group size G:
  qweight int32 [in, out/8], qzeros int32 [in/G, out/8], scales fp16 [in/G, out]
and the dequantized matrix is Wd[in, out] = (q - z) * s, so y = x @ Wd.
"""

from __future__ import annotations

import torch

# Nibble i of a packed word holds logical column 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Logical column 8c + j sits at nibble AWQ_REVERSE_ORDER[j].
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] ints in 0..15 -> int32 [rows, cols/8] in AWQ's interleaved order."""
    rows, cols = values.shape
    if cols % 8:
        raise ValueError(f"AWQ packs 8 columns per int32; {cols} is not a multiple of 8")
    v = values.to(torch.int64).view(rows, cols // 8, 8)[..., list(AWQ_ORDER)]  # nibble i <- column ORDER[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    word = (v << shifts).sum(dim=-1)  # fits in 32 bits unsigned
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [rows, cols/8] -> uint8 [rows, cols] of 0..15 in logical column order."""
    shifts = torch.tensor([4 * i for i in AWQ_REVERSE_ORDER], dtype=torch.int32, device=packed.device)
    v = (packed.unsqueeze(-1) >> shifts) & 0xF
    return v.reshape(packed.shape[0], -1).to(torch.uint8)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """Exact AutoAWQ dequantization: Wd[in, out] = (q - z) * s, computed in the scales' dtype."""
    q = unpack_awq(qweight).to(torch.int16)
    z = unpack_awq(qzeros).to(torch.int16).repeat_interleave(group_size, dim=0)
    s = scales.repeat_interleave(group_size, dim=0)
    return (q - z).to(scales.dtype) * s


def quantize_groups(w: torch.Tensor, group_size: int, bits: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AutoAWQ's asymmetric group quantizer over the input dim of W [out, in].

    Returns (q [out, in] int 0..2^bits-1, scales [out, in/G] float32, zeros [out, in/G] int)."""
    out_f, in_f = w.shape
    if in_f % group_size:
        raise ValueError(f"input size {in_f} is not a multiple of the group size {group_size}")
    qmax = 2**bits - 1
    g = w.float().reshape(out_f, in_f // group_size, group_size)
    wmax, wmin = g.amax(dim=-1), g.amin(dim=-1)
    scales = (wmax - wmin).clamp(min=1e-5) / qmax
    zeros = (-torch.round(wmin / scales)).clamp(0, qmax)
    q = (torch.round(g / scales[..., None]) + zeros[..., None]).clamp(0, qmax)
    return q.reshape(out_f, in_f).to(torch.int32), scales, zeros.to(torch.int32)


def pseudo_quantize(w: torch.Tensor, group_size: int, bits: int = 4) -> torch.Tensor:
    """W -> Q(W) dequantized back to W's shape and dtype (what the int4 model will compute with)."""
    q, scales, zeros = quantize_groups(w, group_size, bits)
    out_f, in_f = w.shape
    g = (q.view(out_f, -1, group_size) - zeros[..., None]).float() * scales[..., None]
    return g.reshape(out_f, in_f).to(w.dtype)


def pack_linear(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Quantize W [out, in] to the AutoAWQ GEMM tensors {qweight, qzeros, scales (fp16)}.

    The fp16 scales are the ones used for the integer codes, so dequantize_awq reproduces
    pseudo_quantize up to fp16 rounding of the scale."""
    q, scales, zeros = quantize_groups(w, group_size)
    scales16 = scales.to(torch.float16)
    return {
        "qweight": pack_awq(q.t().contiguous()),  # [in, out/8]
        "qzeros": pack_awq(zeros.t().contiguous()),  # [in/G, out/8]
        "scales": scales16.t().contiguous(),  # [in/G, out]
    }
