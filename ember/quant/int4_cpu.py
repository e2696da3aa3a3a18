"""Group-wise int4 weights in the layout of torch's CPU int4 kernel, shared by AWQ and GGUF.

`aten._weight_int4pack_mm_for_cpu(x, packed, G, scales_zeros)` computes x @ W^T with
    W[n, k] = (q[n, k] - 8) * s[k // G, n] + z[k // G, n]
from `packed` = uint8 [N, K/2] and `scales_zeros` = [K/G, N, 2] (s, z) in x's dtype (bf16,
fp16 or fp32 -- the kernel refuses a mismatch). Packed layout, found by probing the
converter: rows go in blocks of B = block_n(); inside block b the bytes [b*B*K/2, (b+1)*B*K/2)
are [K, B/2], and byte (k, j) holds row Bb + j in its low nibble and row Bb + B/2 + j in its
high nibble. B depends on the CPU ATen's kernels run on: 64 with AVX-512, 32 with AVX2 (a
layout built for one and run on the other computes with scrambled rows), so block_n() asks
the converter once.

Every format here is affine per group, w = q * scale + offset (Q4_0: offset -8d; Q4_1: m;
Q4_K: -dmin*m_j; AWQ: -z*s), so it maps onto the kernel exactly: s = scale,
z = offset + 8 * scale. The integer codes are copied, never requantized.

The kernel reads each weight once per row of x, so it wins only for decode-sized batches;
above gemm_dispatch.INT4_KERNEL_MAX_ROWS rows the weight is dequantized (into a transient buffer) and the
dense GEMM takes over, as vLLM does for AWQ at >= 256 tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember.quant import gemm_dispatch

SUPPORTED_GROUP_SIZES = (32, 64, 128, 256)


def _direct_pack(q: torch.Tensor, block: int) -> torch.Tensor:
    N, K = q.shape
    b = q.to(torch.uint8).view(N // block, 2, block // 2, K).permute(0, 3, 1, 2)  # [nb, K, 2, B/2]
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(N, K // 2).contiguous()


_BLOCK_N: int | None = None  # block_n's answer, once probed


def block_n() -> int:
    """Rows per block of torch's packed layout on this CPU (64 or 32), probed against its converter once
    (the first packing does it, at load: a traced step that reads rows finds a plain int here)."""
    global _BLOCK_N
    if _BLOCK_N is None:
        _BLOCK_N = _probe_block_n()
    return _BLOCK_N


def _probe_block_n() -> int:
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0))
    ref = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
    for block in (64, 32):
        if torch.equal(_direct_pack(q, block), ref):
            return block
    raise RuntimeError(
        "torch's CPU int4 pack layout is neither of the known ones (64- or 32-row blocks); "
        "this torch build is not supported by ember's int4 path"
    )


def pack_int4_codes(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15, N % 64 == 0 -> the kernel's packed uint8 [N, K/2]."""
    # direct construction of the probed layout (the converter needs an int32 copy)
    return _direct_pack(q, block_n())


def unpack_int4_codes(packed: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """Inverse of pack_int4_codes: uint8 [N, K/2] -> q uint8 [N, K]."""
    B = block_n()
    b = packed.view(N // B, K, B // 2)
    q = torch.stack((b & 15, b >> 4), dim=1)  # [nb, 2, K, B/2]
    return q.permute(0, 1, 3, 2).reshape(N, K)


def row_codes(packed: torch.Tensor, N: int, K: int, ids: torch.Tensor) -> torch.Tensor:
    """The codes of rows `ids` alone, uint8 [len(ids), K] (only their bytes are read)."""
    B = block_n()
    blk, j = ids // B, ids % B
    byte = packed.view(N // B, K, B // 2)[blk, :, j % (B // 2)]  # [n, K]
    return (byte >> (4 * (j // (B // 2))).to(torch.uint8)[:, None]) & 15


class Int4Weight:
    """One [N, K] weight as int4 codes + per-group (s, z); `linear(x)` = x @ W^T."""

    def __init__(self, packed: torch.Tensor, scales_zeros: torch.Tensor, group_size: int, N: int, K: int):
        self.packed, self.scales_zeros, self.group_size, self.N, self.K = packed, scales_zeros, group_size, N, K

    @classmethod
    def from_affine(
        cls, q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, group_size: int, dtype: torch.dtype
    ) -> "Int4Weight":
        """W[n, k] = q[n, k] * scale[n, k // G] + offset[n, k // G]; q in 0..15, scale/offset [N, K/G]."""
        N, K = q.shape
        if group_size not in SUPPORTED_GROUP_SIZES or K % group_size or N % 64:
            raise ValueError(
                f"int4 kernel needs group size in {SUPPORTED_GROUP_SIZES} dividing K={K} and N % 64 == 0 "
                f"(got G={group_size}, N={N})"
            )
        s = scale.float()
        z = offset.float() + 8.0 * s
        sz = torch.stack((s.t(), z.t()), dim=-1).to(dtype).contiguous()  # [K/G, N, 2]
        return cls(pack_int4_codes(q), sz, group_size, N, K)

    @staticmethod
    def supports(N: int, K: int, group_size: int) -> bool:
        return group_size in SUPPORTED_GROUP_SIZES and K % group_size == 0 and N % 64 == 0

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.packed, self.scales_zeros

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """W [N, K] in `dtype` (default: the scales' dtype)."""
        N, K, G = self.N, self.K, self.group_size
        dtype = dtype or self.scales_zeros.dtype
        sz = self.scales_zeros.to(dtype)
        s = sz[..., 0].t().reshape(N, K // G, 1)
        z = (sz[..., 1] - 8 * sz[..., 0]).t().reshape(N, K // G, 1)
        # Write rows in place: block b's bytes are [K, B/2], so read them transposed; the nibble
        # extraction does the transpose, with no separate permute copy (0.6 vs 1.0 ms at 1536 x 576).
        B = block_n()
        b = self.packed.view(N // B, K, B // 2).transpose(1, 2)  # [nb, B/2, K]
        out = torch.empty(N // B, 2, B // 2, K, dtype=dtype, device=self.packed.device)
        out[:, 0].copy_(b & 15)
        out[:, 1].copy_(b >> 4)
        out = out.view(N, K // G, G)
        out.mul_(s).add_(z)  # (q - 8) * s + z == q * s + (z - 8 s)
        return out.view(N, K)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.K)
        if gemm_dispatch.int4_kernel(x2):
            if x2.dtype != self.scales_zeros.dtype:
                x2 = x2.to(self.scales_zeros.dtype)
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x2.contiguous(), self.packed, self.group_size, self.scales_zeros
            )
            y = y.to(x.dtype)
            if bias is not None:
                y = y + bias
        else:
            y = F.linear(x2, self.dequantize(x2.dtype), bias)
        return y.view(*lead, self.N)
