"""GGUF quantized blocks in torch: the raw-block tensor the loader hands out, and vectorized unpacking.

Block layouts: shared/research/formats.md section 3.4. Every legacy / 4-bit K format here is
affine per group of 32 weights, w = code * scale + offset, so it unpacks to integer codes plus
per-group (scale, offset) that kernels can use as they are:

    Q4_0  codes 0..15,  scale d,      offset -8d
    Q4_1  codes 0..15,  scale d,      offset m
    Q4_K  codes 0..15,  scale d*sc_j, offset -dmin*m_j   (8 sub-blocks of 32 per 256)
    Q5_0  codes 0..31,  scale d,      offset -16d
    Q5_1  codes 0..31,  scale d,      offset m
    Q5_K  codes 0..31,  scale d*sc_j, offset -dmin*m_j   (Q4_K's scales, a fifth bit per code in qh)
    Q8_0  codes 0..255, scale d,      offset -128d       (the int8 shifted by +128)

`dequantize` computes code * scale + offset in float32 in the same order as gguf-py, so it
matches `gguf.quants.dequantize` bit for bit. Q6_K (sub-blocks of 16, int8 scales, not affine
per 32) unpacks to 6-bit codes plus per-16 scales (`q6_k_codes`, w = scale * (q6 - 32)); any
other type goes through gguf-py (numpy) as a slow but complete fallback.

A GGUFTensor is a view of the file's read-only map until it is copied (`raw()`, a row permutation);
the copy then drops the pages it read from this process's resident set (`release_pages`): they
stay in the page cache, but are not counted a second time beside the packed copy in RSS.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as np_dequantize

GROUP = 32  # group size of every affine format above
AFFINE_4BIT = (T.Q4_0, T.Q4_1, T.Q4_K)  # codes fit the int4 kernel as they are
AFFINE_8BIT = (T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0)  # codes need more than 4 bits
FLOAT_TYPES = (T.F32, T.F16, T.BF16)


class GGUFTensor:
    """A quantized 2-D GGUF weight as its raw blocks: uint8 [rows, bytes_per_row], logical [out, in].

    `data` is a numpy view into the file's memory map (no copy) until something narrows or
    permutes it; `raw()` gives a torch copy. Rows are independent runs of blocks, so row
    operations (the llama q/k un-permutation, output-dim TP splits) are exact on raw bytes.
    """

    def __init__(self, qtype: T, data: np.ndarray, shape: tuple[int, int], input_order: np.ndarray | None = None):
        self.qtype, self.data, self.shape = T(qtype), data, tuple(shape)
        # logical column c is the blocks' column input_order[c] (None: the identity); see with_input_order
        self.input_order = input_order
        block, size = GGML_QUANT_SIZES[self.qtype]
        assert data.shape == (shape[0], shape[1] // block * size), (data.shape, shape, self.qtype)

    def with_input_order(self, order: np.ndarray) -> "GGUFTensor":
        """The matrix whose column c is this one's column order[c], with the blocks unmoved (columns
        inside a block cannot move): the packed parts read x's columns in the blocks' order instead
        (gguf_quant.InputOrderPart), and `dequantize` moves the columns."""
        if self.input_order is not None:
            order = self.input_order[order]
        return GGUFTensor(self.qtype, self.data, self.shape, np.asarray(order, dtype=np.int64))

    @property
    def ndim(self) -> int:
        return 2

    def dim(self) -> int:
        return 2

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def narrow(self, dim: int, start: int, length: int) -> "GGUFTensor":
        """torch.Tensor.narrow on the logical shape (the input dim must cut at block edges)."""
        rows, cols = self.shape
        if dim == 0:
            return GGUFTensor(self.qtype, self.data[start : start + length], (length, cols), self.input_order)
        if self.input_order is not None:
            if (start, length) == (0, cols):
                return self
            raise ValueError("a GGUF matrix with reordered input columns cannot be split along its input dim")
        block, size = GGML_QUANT_SIZES[self.qtype]
        if start % block or length % block:
            raise ValueError(f"{self.qtype.name} cannot be split inside a block of {block} (at {start}+{length})")
        return GGUFTensor(
            self.qtype, self.data[:, start // block * size : (start + length) // block * size], (rows, length)
        )

    def permute_rows(self, order: np.ndarray) -> "GGUFTensor":
        out = GGUFTensor(self.qtype, self.data[order], self.shape, self.input_order)
        release_pages(self.data)
        return out

    def take_rows(self, rows: np.ndarray) -> "GGUFTensor":
        """These rows, in this order (a subset: the parts of a fused projection)."""
        return GGUFTensor(self.qtype, self.data[rows], (len(rows), self.shape[1]), self.input_order)

    def raw(self) -> torch.Tensor:
        """uint8 [rows, bytes_per_row], an owned copy (the map is read-only); the map's pages it
        read leave this process's resident set."""
        out = torch.from_numpy(np.array(self.data, dtype=np.uint8, copy=True))
        release_pages(self.data)
        return out

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        w = dequantize(self.raw(), self.qtype, self.shape[1])
        if self.input_order is not None:
            w = w[:, torch.from_numpy(self.input_order)]
        return w.to(dtype)

    def __repr__(self) -> str:
        return f"GGUFTensor({self.qtype.name}, shape={self.shape})"


def release_pages(data: np.ndarray) -> None:
    """Drop the pages of a read-only file map under `data` (a view of it) from this process's
    resident set, once they have been copied: MADV_DONTNEED on a shared read-only file mapping
    only unmaps them (the page cache keeps them; reading them again faults them back in).
    Anything that is not a view of a map is left alone."""
    root = data
    while isinstance(root, np.ndarray) and not isinstance(root.base, mmap.mmap):
        root = root.base
    if not isinstance(root, np.ndarray) or getattr(root, "offset", 0) or not data.size:
        return  # not a view of a map (or of one mapped from inside the file: offsets unknown)
    start = data.ctypes.data - root.ctypes.data
    if not 0 <= start < root.nbytes:
        return
    lo = start - start % mmap.PAGESIZE
    span = int(np.prod(data.shape[1:], dtype=np.int64)) * data.itemsize  # a row's stride can exceed its bytes
    hi = start + (data.shape[0] - 1) * data.strides[0] + span if data.ndim else start + data.itemsize
    try:
        root.base.madvise(mmap.MADV_DONTNEED, lo, min(hi, root.nbytes) - lo)
    except (OSError, ValueError):  # a platform without madvise: the pages stay resident
        pass


def _blocks(raw: torch.Tensor, qtype: T) -> torch.Tensor:
    """uint8 [rows, bytes_per_row] -> [rows * blocks_per_row, block_bytes]."""
    return raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per row -> float32 [n, 1]."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, width: int) -> torch.Tensor:
    """[n, chunks * width] bytes -> [n, chunks * 2 * width]: each chunk's low nibbles, then its high ones."""
    q = qs.reshape(qs.shape[0], -1, 1, width)
    return torch.cat((q & 15, q >> 4), dim=2).reshape(qs.shape[0], -1)


def affine_codes(raw: torch.Tensor, qtype: T) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes uint8 [rows, K], scale f32 [rows, K/32], offset f32 [rows, K/32]) for the affine types."""
    rows = raw.shape[0]
    b = _blocks(raw, qtype)
    if qtype == T.Q4_0:
        d = _f16(b[:, 0:2])
        codes, scale, offset = _nibbles(b[:, 2:], 16), d, -8 * d
    elif qtype == T.Q4_1:
        codes, scale, offset = _nibbles(b[:, 4:], 16), _f16(b[:, 0:2]), _f16(b[:, 2:4])
    elif qtype == T.Q8_0:
        d = _f16(b[:, 0:2])
        codes = (b[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        scale, offset = d, -128 * d
    elif qtype in (T.Q5_0, T.Q5_1):
        d = _f16(b[:, 0:2])
        at = 2 if qtype == T.Q5_0 else 4
        qh = b[:, at : at + 4].contiguous().view(torch.int32)  # bit i = high bit of element i
        high = (qh >> torch.arange(32, dtype=torch.int32, device=qh.device)) & 1
        codes = _nibbles(b[:, at + 4 :], 16) | (high.to(torch.uint8) << 4)
        scale, offset = d, (-16 * d if qtype == T.Q5_0 else _f16(b[:, 2:4]))
    elif qtype in (T.Q4_K, T.Q5_K):
        d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
        sc, m = _k_scale_min(b[:, 4:16])
        if qtype == T.Q4_K:
            codes = _nibbles(b[:, 16:], 32)
        else:  # bit j of qh[l] is the fifth bit of sub-block j's code l
            high = (b[:, 16:48].reshape(-1, 1, 32) >> _BITS.to(b.device).view(1, 8, 1)) & 1
            codes = _nibbles(b[:, 48:], 32) | (high.reshape(b.shape[0], -1) << 4)
        scale, offset = d * sc, dmin * m
        offset = -offset
    else:
        raise ValueError(f"{qtype.name} is not an affine group-of-32 format")
    return codes.reshape(rows, -1), scale.reshape(rows, -1), offset.reshape(rows, -1)


_BITS = torch.arange(8, dtype=torch.uint8)
K_QUANTS = (T.Q4_K, T.Q5_K)  # affine per 32 with two-level scales


def k_quant_fields(
    raw: torch.Tensor, qtype: T
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K -> their fields as they are: (codes uint8 [rows, K], sc uint8 [rows, K/32], m uint8
    [rows, K/32], d float16 [rows, K/256], dmin float16 [rows, K/256]); affine_codes' scale = d * sc and
    offset = -dmin * m (both exact in float32)."""
    rows = raw.shape[0]
    codes, _, _ = affine_codes(raw, qtype)
    b = _blocks(raw, qtype)
    sc, m = (v.to(torch.uint8) for v in _k_scale_min(b[:, 4:16]))  # 6-bit integers, held as float32 there
    d, dmin = (b[:, at : at + 2].contiguous().view(torch.float16) for at in (0, 2))
    return codes, sc.reshape(rows, -1), m.reshape(rows, -1), d.reshape(rows, -1), dmin.reshape(rows, -1)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K 12-byte packed 6-bit (scale, min) for 8 sub-blocks -> two float32 [n, 8]."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((d & 63, (md & 15) | ((d >> 2) & 48)), dim=1)
    mn = torch.cat((m & 63, (md >> 4) | ((m >> 2) & 48)), dim=1)
    return sc.float(), mn.float()


def q6_k_blocks(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K -> its fields as they are: (q6 uint8 [rows, K] in 0..63, S int8 [rows, K/16], d float16
    [rows, K/256]), w = d * S * (q6 - 32) per sub-block of 16."""
    rows = raw.shape[0]
    b = _blocks(raw, T.Q6_K)
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    low = _nibbles(ql, 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    high = (qh.reshape(n, 2, 1, 32) >> shifts) & 3
    q = low | (high.reshape(n, 8, 32) << 4)
    sub = b[:, 192:208].contiguous().view(torch.int8)  # [n, 16]
    d = b[:, 208:210].contiguous().view(torch.float16)  # [n, 1]
    return q.reshape(rows, -1), sub.reshape(rows, -1), d.reshape(rows, -1)


def q6_k_codes(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q6_K -> (q6 uint8 [rows, K] in 0..63, scale float32 [rows, K/16] = d * S, exact), so that
    w = scale * (q6 - 32) per sub-block of 16."""
    q, sub, d = q6_k_blocks(raw)
    scale = d.float().repeat_interleave(16, dim=1) * sub.float()  # 11 x 8 significant bits: exact
    return q, scale


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    q, scale = q6_k_codes(raw)
    n = q.numel() // 16
    return scale.reshape(n, 1) * (q.reshape(n, 16).to(torch.int8) - 32).float()


def dequantize(raw: torch.Tensor, qtype: T, cols: int) -> torch.Tensor:
    """uint8 [rows, bytes_per_row] -> float32 [rows, cols], equal to gguf.quants.dequantize."""
    rows = raw.shape[0]
    if qtype in AFFINE_4BIT or qtype in AFFINE_8BIT:
        codes, scale, offset = affine_codes(raw, qtype)
        w = codes.view(rows, -1, GROUP).float() * scale.unsqueeze(-1) + offset.unsqueeze(-1)
    elif qtype == T.Q6_K:
        w = _q6_k(raw)
    else:  # every other type gguf-py knows
        w = torch.from_numpy(np.asarray(np_dequantize(raw.cpu().numpy(), qtype), dtype=np.float32)).to(raw.device)
    return w.reshape(rows, cols)
