"""GGUF weights kept packed in memory (`--quantization gguf`, the default for a .gguf file).

Each Linear shard (q/k/v, gate/up) arrives from the loader as a GGUFTensor of raw blocks and is
stored by its type, with no dense copy:

- Q4_0, Q4_1, Q4_K: affine 4-bit codes with per-32 (scale, offset) -> torch's CPU int4 kernel
  (Int4Weight), codes copied exactly. Adjacent shards of this kind are packed into ONE
  Int4Weight, so a Q4 qkv_proj is one kernel call.
- Q8_0 (and Q5_0 / Q5_1 / Q5_K, whose 5-bit codes are affine per 32 too; Q4_K_M files hold Q5_K
  in attn_qkv): the 8-bit codes split exactly into two nibbles, q8 + 128 = 16 hi + lo, laid side
  by side along the input dim in one Int4Weight [N, 2K]:
  x @ W^T = [x, x] @ [16d*hi | d*lo + off]^T. One kernel call, 1 byte + scales per weight.
- Where the tiled GEMV takes the run's dtype (bf16 on AVX-512 BF16, float32 on AVX2), all of the
  above are a TiledPart instead (its row tiles, the 8-bit codes whole); Q4_K and Q5_K keep the file's
  two levels of scales there (6-bit sc, m per 32, float16 d, dmin per 256: 0.58 / 1.08 B a weight,
  against 0.75 / 1.25 with flat float32 scales), the same values exactly.
- Q6_K (Q4_K_M files hold it in output.weight and half the attn_v / ffn_down): 16 sub-blocks
  of 16 with scale c = d * S (int8 S, either sign), w = c (q6 - 32), q6 in 0..63.
  Where the tiled GEMV takes the run's dtype it is a TiledQ6KPart: the tiled GEMV's Q6_K tiles hold
  the file's own bits (6-bit codes, int8 S, float16 d: 0.82 B a weight); bf16 on AVX-512 BF16: its
  bf16 GEMV serves few rows and its int8-x path many; float32 on AVX2: its int16-x GEMV every row
  count (no dense copy, no rebuilt weight either way); rows come back exactly
  (ember.kernels.cpu_tiled_gemv). Elsewhere (bf16 on AVX2, --no-cpu-tiled-gemv) it is a Q6KPart, as
  follows. Split
  q6 = 16 hi + lo (hi 0..3, lo 0..15) and give each sub-block one kernel group of 32 in an
  Int4Weight [N, 2K]: its 16 codes hi + 6, then its 16 codes lo, both with s = 16 c and
  z = 8 s / 17, fed x' = [x_0:16, x_0:16 / 16, x_16:32, x_16:32 / 16, ...] (exact: a power of 2).
  Per input k the kernel's (q - 8) s + z gives
      ((hi + 6 - 8) s + z) + ((lo - 8) s + z) / 16 = c (16 hi + lo - 40) + 17 z / 16 = c (q6 - 32).
  (Any shift works with z = s (104 - 16 shift) / 17; 6 keeps z small, so bf16 rounding of s and
  z moves a weight by <= ~0.19 c, like a dense bf16 weight's <= 0.125 c; with the plain codes,
  z = 104 s / 17, that was ~0.8 c.) Codes and s are exact; in float32 only z rounds (~1e-5 c).
  One kernel call per part, 1 byte of codes + (s, z) per 16 weights: 1.25 B/weight in bf16
  (1.5 in fp32; the file has 0.82). At one row it runs as fast as a dense bf16 GEMV; the 2K-wide
  call costs per row, so above Q6K_KERNEL_MAX_ROWS rows the bf16 weight is rebuilt per call for a
  dense GEMM (docs/tuning.md, row-count crossovers). Rows for lookups / the head's refinement come from the
  codes and s alone, bit-exact in float32. An embedding that is only looked up (untied) keeps
  Q6_K raw (as small as the Q6_K tiles; a lookup dequantizes just its rows).
- Q2_K, Q3_K, IQ4_NL, IQ4_XS and the grid-coded IQ types: the file's own blocks as a BlockPart, run by the
  block GEMV (ember.quant.gguf_block_part; CPU, --cpu-block-gemv). Elsewhere, and the other types:
  dequantized once at load to the run dtype (dense), or kept raw in a lookup-only embedding.
- F32 / F16 / BF16: dense in the run dtype; except BF16 / F16 matrices in a float32 run on CPU
  (AVX2 + FMA + F16C, --cpu-half-weights), which stay 16-bit as a HalfPart: a C++ GEMV widens them
  in registers (ember.kernels.cpu_half_gemv), the file's bytes in RAM and per decode step, the same
  float32 products.

A fused layer with mixed types holds one part per run of same-kind shards and concatenates their
outputs. The int4 kernel wants its scales in the activation dtype: in float32 runs the repack is
exact (the kernel's zero z = offset + 8 scale may round by an ulp); in bfloat16 runs the fp16
block scales round to bf16, an error of the same order as holding the weights in bf16. Speed:
torch vectorizes the int4 kernel for bf16 only (docs/tuning.md), so float32 runs are exact but
slow; bf16 is the packed path's speed mode (and with fp32 scales, fp32 runs hold ~1.25x the file's bytes).

The token embedding and the LM head use the same parts: a lookup gathers and unpacks only the
rows it needs, the head is a `linear`. A tied LM head shares the embedding's method and data.
MoE experts (GGUFExperts) keep each expert packed the same way: gate;up as one fused pair of
shards, down as one, run through moe_compute.grouped_experts. On CPU, experts of every quantized type
keep the layer's raw blocks stacked [E, rows, row_bytes] instead and run in one block_moe call
(ember.kernels.cpu_block_gemv: only the chosen experts read, no host sync, so a graph too).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch import nn

from ember.errors import ModelLoadError
from ember.kernels import cpu_half_gemv, cpu_row_top
from ember.kernels import cpu_tiled_gemv as tiled_gemv
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.activation import silu_and_mul
from ember.layers.linear import QuantMethod, dense_linear, new_param
from ember.layers.moe_compute import experts_forward, register_experts
from ember.quant import gemm_dispatch
from ember.quant.gguf_blocks import (
    AFFINE_4BIT,
    AFFINE_8BIT,
    GROUP,
    K_QUANTS,
    GGUFTensor,
    affine_codes,
    dequantize,
    k_quant_fields,
    q6_k_blocks,
    q6_k_codes,
)
from ember.quant.int4_cpu import Int4Weight, block_n, pack_int4_codes, row_codes
from ember.quant.quant_config import QuantConfig

# Raw-block parts dequantize at most this many weights at a time (64 MiB of float32).
RAW_CHUNK_ELEMS = 1 << 24
# Packed parts are built this many rows at a time (a multiple of every kernel's row block), so that
# a 248K-row embedding is never unpacked whole on its way to the kernel's layout.
PACK_CHUNK_ROWS = 4096
# Q6_K's high 2-bit codes are stored as hi + 6 (6..9), near the kernel's zero point 8: this keeps
# the bf16-rounded zero small (module docstring). Q6KPart._weight relies on 16 (hi + 6) + lo = q6 + 96.
Q6K_HI_SHIFT = 6
# A low-precision LM head recomputes this many top candidates in float32 (for up to
# gemm_dispatch.REFINE_MAX_ROWS rows).
REFINE_TOP_K = 8


# ---- packed weights: one [N, K] matrix each, with linear / rows / dequantize -------------------


class PackedPart:
    N: int
    K: int

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> x @ W^T [..., N] in x's dtype."""
        raise NotImplementedError

    def linear_float(self, x: torch.Tensor) -> torch.Tensor:
        """The same in float32 (the LM head's logits)."""
        return self.linear(x).float()

    def precise_logits(self, x: torch.Tensor) -> bool:
        """Whether linear_float(x) is as precise as the activations reaching the head already are
        (exact weight x input products summed in float32, or x rounded no coarser than every layer
        before the head rounds it), so there is nothing for the LM head's refinement to recompute."""
        return x.dtype == torch.float32

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """W[ids] as float32 [len(ids), K] (the embedding lookup)."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """W as float32 [N, K]."""
        return self.rows(torch.arange(self.N, device=self.buffers()[0].device))

    def buffers(self) -> list[torch.Tensor]:
        raise NotImplementedError


class DensePart(PackedPart):
    kernel_at_any_rows = True  # a dense GEMM at every row count already: a dense copy would only duplicate it
    plain_matrix = True  # w is the [N, K] matrix itself (fused kernels may read it: hyper_connection.plain_weight)

    def __init__(self, w: torch.Tensor):
        self.w, (self.N, self.K) = w, w.shape

    def linear(self, x):
        return dense_linear(x, self.w)

    def rows(self, ids):
        return self.w[ids].float()

    def buffers(self):
        return [self.w]


class HalfPart(PackedPart):
    """A BF16 / F16 matrix kept in its 16-bit form under float32 activations (ember.kernels.cpu_half_gemv):
    its GEMV for up to gemm_dispatch.HALF_GEMV_MAX_ROWS rows, cache-sized widened panels for torch's
    float32 GEMM above. Lookups widen only their rows. Products are exact in float32 either way, as
    over the weight widened at load."""

    kernel_at_any_rows = True  # the panels are a dense GEMM already
    plain_matrix = True  # w is the [N, K] 16-bit matrix itself (hyper_connection.plain_weight)

    def __init__(self, w: torch.Tensor):
        self.w, (self.N, self.K) = w.contiguous(), w.shape

    @staticmethod
    def usable(dtype: torch.dtype, device, kernels: CpuKernels | None = None) -> bool:
        """Whether 16-bit matrices stay 16-bit in a run of `dtype` on `device`: float32 on CPU, the
        model's kernels allow it (--cpu-half-weights) and the kernel builds here."""
        return (
            dtype == torch.float32
            and torch.device(device).type == "cpu"
            and (kernels or CpuKernels()).half_weights
            and cpu_half_gemv.available()
        )

    def linear(self, x):  # x is float32: usable() made this part for float32 runs only
        y = cpu_half_gemv.linear(x.reshape(-1, self.K).contiguous(), self.w, gemm_dispatch.HALF_GEMV_MAX_ROWS)
        return y.reshape(*x.shape[:-1], self.N)

    def rows(self, ids):
        return self.w[ids].float()

    def dequantize(self):
        return self.w.float()

    def buffers(self):
        return [self.w]


class Int4Part(PackedPart):
    """W = code * scale + offset per group of 32, in an Int4Weight. Rows are padded to the
    kernel's multiple of 64 (padding rows are zero and cut from the output).
    `split8` marks 8-bit codes stored as [hi | lo] nibbles along K (see the module docstring)."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, dtype: torch.dtype, split8: bool = False
    ):
        self.N, self.K = codes.shape
        self.split8 = split8
        if split8:  # s*c + o = 16s*hi + (s*lo + o)
            codes = torch.cat((codes >> 4, codes & 15), dim=1)
            scale, offset = torch.cat((16 * scale, scale), dim=1), torch.cat((torch.zeros_like(offset), offset), dim=1)
        pad = -self.N % 64
        if pad:
            codes, scale, offset = (F.pad(t, (0, 0, 0, pad)) for t in (codes, scale, offset))
        self.w = Int4Weight.from_affine(codes, scale, offset, GROUP, dtype)

    @staticmethod
    def supports(K: int) -> bool:
        return Int4Weight.supports(64, K, GROUP)

    def linear(self, x):
        if self.split8:
            if gemm_dispatch.int4_kernel(x):
                y = self.w.linear(torch.cat((x, x), dim=-1))
            else:  # many rows: one dense GEMM over the summed halves
                y = F.linear(x, self._summed().to(x.dtype))
        else:
            y = self.w.linear(x)
        return y if y.shape[-1] == self.N else y[..., : self.N]

    def _summed(self) -> torch.Tensor:
        w = self.w.dequantize(torch.float32)[: self.N]
        return w.view(self.N, 2, self.K).sum(1) if self.split8 else w

    def dequantize(self):
        return self._summed()

    def rows(self, ids):
        w, G = self.w, GROUP
        codes = _row_codes(w, ids)
        sz = w.scales_zeros[:, ids].float().transpose(0, 1)  # [n, K/G, 2]
        vals = (codes.view(len(ids), w.K // G, G).float() - 8) * sz[..., :1] + sz[..., 1:]
        vals = vals.view(len(ids), w.K)
        return vals.view(len(ids), 2, self.K).sum(1) if self.split8 else vals

    def buffers(self):
        return [self.w.packed, self.w.scales_zeros]


class TiledPart(PackedPart):
    """W = code * scale + offset per group of 32, in the row tiles of the CPU GEMV kernel
    (ember.kernels.cpu_tiled_gemv): 4-bit codes (Q4_0, Q4_1, Q4_K) or whole 8-bit ones (Q8_0,
    Q5_0, Q5_1, Q5_K); scales flat (float16 or float32 per 32) or, for a run of Q4_K / Q5_K shards,
    their two levels as the file holds them (tiled_gemv.pack_k). Used in place of Int4Part for bf16 on
    CPUs with AVX-512 BF16 (faster at one row: docs/tuning.md, CPU kernels) and for float32 on CPUs
    with AVX2 (the kernel's int16-x build). From TILED_Q8_MIN_ROWS rows on a CPU with AVX-512 VNNI (has_q8, --cpu-int8-activations), the
    kernel's int8-x path (x rounded to int8 steps per group of 32, as llama.cpp's Q8 activations),
    which beats oneDNN's bf16 GEMM over a dense copy at every row count. Otherwise, above
    INT4_KERNEL_MAX_ROWS rows, a dense GEMM over W -- except in the AVX2 build, whose many-row path
    beats the float32 GEMM at every row count (ember.quant.gemm_dispatch.tiled_path chooses).

    int8_activations: the model's CpuKernels.int8_activations (--cpu-int8-activations)."""

    def __init__(
        self, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, int8_activations: bool = True
    ):
        """codes None: an empty part for from_chunks to fill."""
        if codes is not None:
            self.N, self.K = codes.shape
        self.bits = bits
        self.x_dtype = tiled_gemv.x_dtype()  # read here: a compiled step cannot trace the CPU-flags lookup
        # many-row paths: the int8-x one (has_q8) and the AVX2 build's widened tiles: every row count
        self.q8 = int8_activations and tiled_gemv.has_q8()
        self.max_rows = None if tiled_gemv.rounds_x() or self.q8 else gemm_dispatch.INT4_KERNEL_MAX_ROWS
        if codes is not None:
            self.tiles, self.scale, self.offset = tiled_gemv.pack(codes, scale, offset, bits)

    @classmethod
    def from_chunks(
        cls, N: int, K: int, chunks, bits: int, int8_activations: bool = True, pack=tiled_gemv.pack
    ) -> "TiledPart":
        """The part of row chunks (each chunk but the last a multiple of the kernel's tile rows), packed a
        chunk at a time into one tensor: no full-size temporaries. A chunk is pack's arguments but bits:
        (codes, scale, offset) of affine_codes for tiled_gemv.pack, or k_quant_fields' for
        tiled_gemv.pack_k (Q4_K / Q5_K's two levels of scales as they are). Flat scales are float16
        only where every chunk's are (as one pack's)."""
        part = cls(None, None, None, bits, int8_activations)
        part.N, part.K = N, K
        tiles, scales, offsets, at = None, [], [], 0
        for chunk in chunks:
            t, s, o = pack(*chunk, bits)
            if tiles is None:
                tiles = torch.empty(-(-N // tiled_gemv.ROWS), *t.shape[1:], dtype=t.dtype, device=t.device)
            tiles[at : at + t.shape[0]] = t
            scales.append(s)
            offsets.append(o)
            at += t.shape[0]
        if at != tiles.shape[0]:
            raise ValueError(f"tiled chunks cover {at} tiles, not {tiles.shape[0]} (only the last may be short)")
        part.tiles = tiles
        if scales[0].dtype == torch.uint8:  # K-quant scales: one form for all chunks
            part.scale, part.offset = torch.cat(scales), torch.cat(offsets)
            return part
        wide = torch.float32 if any(s.dtype == torch.float32 for s in scales + offsets) else torch.float16
        part.scale, part.offset = (torch.cat([t.to(wide) for t in ts]) for ts in (scales, offsets))
        return part

    @staticmethod
    def usable(dtype: torch.dtype, device, kernels: CpuKernels | None = None) -> bool:
        """Whether weights in `dtype` on `device` take this layout: the model's kernels allow it
        (--cpu-tiled-gemv), this machine's build takes that dtype, and it builds."""
        return (
            torch.device(device).type == "cpu"
            and (kernels or CpuKernels()).tiled_gemv
            and dtype == tiled_gemv.x_dtype()
            and tiled_gemv.available()
        )

    def _path(self, x: torch.Tensor) -> str:
        return gemm_dispatch.tiled_path(x, self.x_dtype, self.q8, self.max_rows)

    def _kernel(self, path: str, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        """The kernel's "q8" or "gemv" path over this part's tiles (x contiguous [M, K])."""
        if path == "q8":
            return tiled_gemv.gemm_q8(x, self.tiles, self.scale, self.offset, self.bits, float_out)
        return tiled_gemv.gemv(x, self.tiles, self.scale, self.offset, self.bits, float_out)

    def _gemv(self, x: torch.Tensor, float_out: bool) -> torch.Tensor:
        x2 = x.reshape(-1, self.K)
        path = self._path(x2)
        if path != "dense":
            y = self._kernel(path, x2.contiguous(), float_out)
        else:
            y = F.linear(x2, self._weight(x2.dtype))
            y = y.float() if float_out else y  # linear_float's contract: float32 logits either way
        y = y if y.shape[-1] == self.N else y[:, : self.N]
        return y.reshape(*x.shape[:-1], self.N)

    @property
    def kernel_at_any_rows(self) -> bool:
        """True where every step runs the kernel (AVX2 build): a dense copy would only cost memory."""
        return self.max_rows is None

    def linear(self, x):
        return self._gemv(x, float_out=False)

    def linear_float(self, x):
        return self._gemv(x, float_out=True)

    def precise_logits(self, x):
        # The bf16 build multiplies exact codes by x's own values and sums in float32; float32 x it
        # does not take runs a float32 GEMM over the exact weight. The AVX2 build rounds float32 x to
        # int16 steps (2^-16 of a group's largest |x|) as it does in every layer before the head, so
        # refining the head's top candidates (~0.24 ms a token on Zen3) could not make its argmax
        # that of an exact float32 model. The int8-x path rounds x for the head alone (the steps that
        # take it reached the head through bf16 hidden states), so its top candidates are recomputed.
        return x.dtype == torch.float32 or self._path(x) == "gemv"

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        return tiled_gemv.dequantize(self.tiles, self.scale, self.offset, self.bits, dtype, self.N)

    def dequantize(self):
        return self._weight(torch.float32)

    def rows(self, ids):
        return tiled_gemv.unpack_rows(self.tiles, self.scale, self.offset, self.bits, ids)

    def buffers(self):
        return [self.tiles, self.scale, self.offset]


class TiledQ6KPart(TiledPart):
    """Q6_K in the tiled GEMV's Q6_K tiles (cpu_tiled_gemv.pack_q6k), its own bits: 6-bit codes, int8
    sub-block scales S per 16 and float16 d per 256, 0.82 B a weight as in the file (Q6KPart: 1.25).
    The bf16 GEMV for few rows, the int8-x path (has_q8) from TILED_Q8_MIN_ROWS rows; in the AVX2 build
    its float32-x GEMV at every row count (its many-row path from 16): so no dense copy and no rebuilt
    weight at many rows; else the rules of TiledPart (gemm_dispatch.tiled_path). Rows for lookups and
    the head's refinement are exactly gguf-py's values. Both builds (has_q6k)."""

    def __init__(self, q6: torch.Tensor, sub_scale: torch.Tensor, d: torch.Tensor, int8_activations: bool = True):
        """q6 None: an empty part for from_chunks to fill."""
        super().__init__(None, None, None, 6, int8_activations)
        if q6 is not None:
            self.N, self.K = q6.shape
            self.tiles, self.sub_scale, self.d = tiled_gemv.pack_q6k(q6, sub_scale, d)

    @classmethod
    def from_chunks(cls, N: int, K: int, chunks, int8_activations: bool = True) -> "TiledQ6KPart":
        """The part of (q6, S, d) row chunks (gguf_blocks.q6_k_blocks of consecutive rows; each chunk
        but the last a multiple of the kernel's tile rows), packed a chunk at a time into one tensor."""
        part = cls(None, None, None, int8_activations)
        part.N, part.K = N, K
        T, at = -(-N // tiled_gemv.ROWS), 0
        for q6, sub, d in chunks:
            t, s, dd = tiled_gemv.pack_q6k(q6, sub, d)
            if at == 0:
                part.tiles, part.sub_scale, part.d = (x.new_empty(T, *x.shape[1:]) for x in (t, s, dd))
            for buf, x in ((part.tiles, t), (part.sub_scale, s), (part.d, dd)):
                buf[at : at + x.shape[0]] = x
            at += t.shape[0]
        if at != T:
            raise ValueError(f"Q6_K chunks cover {at} tiles, not {T} (only the last may be short)")
        return part

    @staticmethod
    def usable(dtype: torch.dtype, device, kernels: CpuKernels | None = None) -> bool:
        return tiled_gemv.has_q6k() and TiledPart.usable(dtype, device, kernels)

    def _kernel(self, path, x, float_out):
        if path == "q8":
            return tiled_gemv.gemm_q8_q6k(x, self.tiles, self.sub_scale, self.d, float_out)
        return tiled_gemv.gemv_q6k(x, self.tiles, self.sub_scale, self.d, float_out)

    def _weight(self, dtype):
        return tiled_gemv.dequantize_q6k(self.tiles, self.sub_scale, self.d, dtype, self.N)

    def rows(self, ids):
        return tiled_gemv.unpack_rows_q6k(self.tiles, self.sub_scale, self.d, ids)

    def buffers(self):
        return [self.tiles, self.sub_scale, self.d]


def _row_codes(w: Int4Weight, ids: torch.Tensor) -> torch.Tensor:
    """The int4 codes of rows `ids` of an Int4Weight, uint8 [len(ids), w.K]."""
    return row_codes(w.packed, w.N, w.K, ids)


class Q6KPart(PackedPart):
    """Q6_K as one Int4Weight [N, 2K] (module docstring): each kernel group of 32 holds a
    sub-block's 16 high codes hi + Q6K_HI_SHIFT, then its 16 low codes lo (q6 = 16 hi + lo),
    with s = 16 c and z = 8 s / 17 for the sub-block's scale c = d * S; the kernel reads
    x' = [x_0:16, x_0:16 / 16, x_16:32, x_16:32 / 16, ...]. Rows padded to a multiple of 64."""

    def __init__(self, q6: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self._build(*q6.shape, [(q6, scale)], dtype)

    @classmethod
    def from_chunks(cls, N: int, K: int, chunks, dtype: torch.dtype) -> "Q6KPart":
        """The part of (q6, scale) row chunks (q6_k_codes of consecutive rows; each chunk but the
        last a multiple of 64 rows), built a chunk at a time: no full-size temporaries."""
        part = cls.__new__(cls)
        part._build(N, K, chunks, dtype)
        return part

    def _build(self, N: int, K: int, chunks, dtype: torch.dtype) -> None:
        self.N, self.K = N, K
        packed, sz, at = None, [], 0
        for q6, scale in chunks:
            n = q6.shape[0]
            q = q6.view(n, K // 16, 1, 16)
            codes = torch.cat(((q >> 4) + Q6K_HI_SHIFT, q & 15), dim=2).reshape(n, 2 * K)
            s = 16 * scale.float()  # [n, K/16]: exact in float32 (fp16 d times int8 S, times 16)
            z = s * ((104 - 16 * Q6K_HI_SHIFT) / 17)  # 8 s / 17
            pad = -n % 64
            if pad:
                codes, s, z = (F.pad(t, (0, 0, 0, pad)) for t in (codes, s, z))
            if packed is None:  # the kernel's layout is row blocks one after another: chunks fill it in order
                packed = torch.empty(N + (-N % 64), K, dtype=torch.uint8, device=q6.device)
            packed[at : at + n + pad] = pack_int4_codes(codes)
            sz.append(torch.stack((s.t(), z.t()), dim=-1).to(dtype))  # [2K/32, n, 2]
            at += n + pad
        if at != packed.shape[0]:
            raise ValueError(f"Q6_K chunks cover {at} rows, not {N} (only the last chunk may be short)")
        self.w = Int4Weight(packed, torch.cat(sz, dim=1).contiguous(), GROUP, at, 2 * K)
        # x' = [x_0:16, x_0:16 / 16, ...] is x times this [K/16, 2, 16] of 1 and 1/16, in the run dtype: a
        # buffer, so that a traced step (dynamo, or export for a package) reads it from the model
        self.spread = torch.tensor([1.0, 1 / 16], dtype=dtype).view(1, 2, 1).expand(K // 16, 2, 16).contiguous()

    @staticmethod
    def supports(K: int) -> bool:
        return Int4Weight.supports(64, 2 * K, GROUP)

    def linear(self, x):
        if gemm_dispatch.q6k_kernel(x):
            m = self.spread.to(x.dtype)  # dividing by 16 is exact in any dtype
            y = self.w.linear((x.reshape(*x.shape[:-1], self.K // 16, 1, 16) * m).reshape(*x.shape[:-1], 2 * self.K))
        else:  # many rows: one dense GEMM over the weight rebuilt in x's dtype
            y = F.linear(x, self._weight(x.dtype))
        return y if y.shape[-1] == self.N else y[..., : self.N]

    def _weight(self, dtype: torch.dtype) -> torch.Tensor:
        """W = c * (q6 - 32) [N, K] in dtype, from the codes and s = 16 c (z is not read), so
        float32 rebuilds gguf-py's values bit for bit. Works in the kernel's byte layout (rows in
        blocks of B = 64 or 32, int4_cpu): byte [b, g, h, i, j] holds sub-block g's code i of half
        h (hi, lo) for row Bb + j in its low nibble and for row Bb + B/2 + j in its high one."""
        w, G16, B = self.w, self.K // 16, block_n()
        b = w.packed.view(w.N // B, G16, 2, 16, B // 2)
        hi, lo = b[:, :, 0], b[:, :, 1]
        v = torch.stack(((hi << 4) | (lo & 15), (hi & 0xF0) | (lo >> 4)), dim=1)  # 16 hi' + lo = q6 + 96
        v ^= 0x80  # as int8: q6 + 96 - 128 = q6 - 32
        s = w.scales_zeros[..., 0].to(dtype).div(16).view(G16, w.N // B, 2, 1, B // 2).permute(1, 2, 0, 3, 4)
        y = v.view(torch.int8).to(dtype) * s  # [N/B, 2, K/16, 16, B/2]; the scale varies along the outer dims
        return y.permute(0, 1, 4, 2, 3).reshape(w.N, self.K)[: self.N]

    def dequantize(self):
        return self._weight(torch.float32)

    def rows(self, ids):
        n = len(ids)
        c = _row_codes(self.w, ids).view(n, self.K // 16, 2, 16)
        q6 = (c[:, :, 0] - Q6K_HI_SHIFT) * 16 + c[:, :, 1]  # uint8 0..63, [n, K/16, 16]
        scale = self.w.scales_zeros[:, ids, 0].t().float().div(16).unsqueeze(-1)  # c, [n, K/16, 1]
        return ((q6.float() - 32) * scale).view(n, self.K)

    def buffers(self):
        return [self.w.packed, self.w.scales_zeros, self.spread]


class RawPart(PackedPart):
    """The raw blocks. Cheap for row lookups; `linear` dequantizes everything per call, a chunk
    of rows at a time (Q6_K: ~20-60x a dense bf16 GEMV), so only lookups use it by default."""

    def __init__(self, raw: torch.Tensor, qtype: T, K: int):
        self.raw, self.qtype, self.N, self.K = raw, qtype, raw.shape[0], K

    def linear(self, x):
        step = max(64, RAW_CHUNK_ELEMS // self.K)
        outs = [
            F.linear(x, dequantize(self.raw[i : i + step], self.qtype, self.K).to(x.dtype))
            for i in range(0, self.N, step)
        ]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def rows(self, ids):
        return dequantize(self.raw[ids], self.qtype, self.K)

    def buffers(self):
        return [self.raw]


class InputOrderPart(PackedPart):
    """A packed matrix whose logical column c is its blocks' column order[c] (GGUFTensor.with_input_order:
    Qwen3.5's ssm_out, whose value heads the converter tiled): the blocks stay as they are and x's
    columns move to the blocks' order instead, x' = x[..., argsort(order)], so x' @ B^T = x @ W^T."""

    def __init__(self, inner: PackedPart, order: torch.Tensor):
        self.inner, self.N, self.K = inner, inner.N, inner.K
        self.order = order.to(torch.int64)
        self.inverse = torch.argsort(self.order)

    def linear(self, x):
        return self.inner.linear(x.index_select(-1, self.inverse))

    def linear_float(self, x):
        return self.inner.linear_float(x.index_select(-1, self.inverse))

    def precise_logits(self, x):
        return self.inner.precise_logits(x)

    @property
    def kernel_at_any_rows(self) -> bool:
        return getattr(self.inner, "kernel_at_any_rows", False)

    def rows(self, ids):
        return self.inner.rows(ids)[:, self.order]

    def dequantize(self):
        return self.inner.dequantize()[:, self.order]

    def buffers(self):
        return [*self.inner.buffers(), self.inverse]


def _is_half(t) -> bool:
    """A BF16 / F16 matrix: the loader hands these over in their own dtype (loader.gguf._to_torch)."""
    return isinstance(t, torch.Tensor) and t.dim() == 2 and t.dtype in cpu_half_gemv.DTYPES


def _kind(t, raw_ok: bool, half_ok: bool = False, block_ok: bool = False) -> str:
    if not isinstance(t, GGUFTensor):
        return f"half {t.dtype}" if half_ok and _is_half(t) else "dense"
    if block_ok and t.qtype in _block_types():
        return f"block {t.qtype.name}"
    if t.qtype in AFFINE_4BIT and Int4Part.supports(t.shape[1]):
        return "int4"
    if t.qtype in AFFINE_8BIT and Int4Part.supports(2 * t.shape[1]):
        return "int8"
    if t.qtype == T.Q6_K and Q6KPart.supports(t.shape[1]) and not raw_ok:
        return "q6k"  # TiledQ6KPart or Q6KPart; a lookup-only embedding keeps Q6_K raw (0.82 B/weight)
    return f"raw {t.qtype.name}" if raw_ok else "dense"


def pack_shards(
    shards: list, dtype: torch.dtype, device, raw_ok: bool = False, kernels: CpuKernels | None = None
) -> list[PackedPart]:
    """Shards (GGUFTensor or float tensors, [n_i, K] each, in output order) -> parts covering
    the same rows in order, one part per run of shards of the same kind. Types with no int4
    form become dense, or RawPart with `raw_ok` (for lookups only: its linear is slow; Q6_K
    too, as its raw blocks are smaller than its Q6KPart). kernels: the model's CpuKernels
    (whether 4/8-bit codes take the tiled GEMV's layout, and its int8-x path)."""
    kernels = kernels or CpuKernels()
    # asked only where a shard is 16-bit: usable() builds the kernel where install did not
    half_ok = any(_is_half(t) for t in shards) and HalfPart.usable(dtype, device, kernels)
    block_ok = _block_ok(shards, device, kernels)
    runs: list[list] = []
    for t in shards:
        if runs and _run_key(runs[-1][0], raw_ok, half_ok, block_ok) == _run_key(t, raw_ok, half_ok, block_ok):
            runs[-1].append(t)
        else:
            runs.append([t])
    return [_pack_run(run, dtype, device, raw_ok, kernels, half_ok, block_ok) for run in runs]


def _block_types() -> tuple:
    from ember.quant.gguf_block_part import BLOCK_TYPES  # it imports PackedPart from here

    return BLOCK_TYPES


def _block_ok(shards: list, device, kernels: CpuKernels) -> bool:
    """Whether the shards' BLOCK_TYPES take a BlockPart (asked only where one has such a type: usable() builds
    the block kernel where install did not)."""
    from ember.quant import gguf_block_part

    block = [t.qtype for t in shards if isinstance(t, GGUFTensor) and t.qtype in _block_types()]
    return bool(block) and all(gguf_block_part.usable(q, device, kernels) for q in block)


def _run_key(t, raw_ok: bool, half_ok: bool, block_ok: bool = False) -> tuple:
    """Shards pack into one part when they are of one kind (and read x's columns in one order)."""
    order = getattr(t, "input_order", None)
    return _kind(t, raw_ok, half_ok, block_ok), None if order is None else id(order)


def _pack_run(
    run: list,
    dtype: torch.dtype,
    device,
    raw_ok: bool,
    kernels: CpuKernels,
    half_ok: bool = False,
    block_ok: bool = False,
) -> PackedPart:
    """One part for a run of shards of the same kind (pack_shards)."""
    kind = _kind(run[0], raw_ok, half_ok, block_ok)
    if kind.startswith("half"):
        return HalfPart(torch.cat(run).to(device))
    order = getattr(run[0], "input_order", None)
    if kind != "dense" and order is not None:  # a dense part moves its columns as it dequantizes
        inner = _pack_run([_unordered(t) for t in run], dtype, device, raw_ok, kernels, block_ok=block_ok)
        return InputOrderPart(inner, torch.from_numpy(order).to(device))
    if kind.startswith("block"):
        from ember.quant.gguf_block_part import BlockPart

        return BlockPart(torch.cat([t.raw() for t in run]).to(device), run[0].qtype, run[0].shape[1])
    if kind == "dense":
        ws = [t.dequantize() if isinstance(t, GGUFTensor) else t for t in run]
        return DensePart(torch.cat(ws).to(device=device, dtype=dtype))
    N, K = sum(t.shape[0] for t in run), run[0].shape[1]
    if kind in ("int4", "int8"):
        bits = 4 if kind == "int4" else 8
        if TiledPart.usable(dtype, device, kernels):
            q8 = kernels.int8_activations
            if tiled_gemv.has_k_scales() and all(t.qtype in K_QUANTS for t in run):  # two levels kept
                chunks = _row_chunks(run, device, k_quant_fields)
                return TiledPart.from_chunks(N, K, chunks, bits, q8, pack=tiled_gemv.pack_k)
            return TiledPart.from_chunks(N, K, _row_chunks(run, device, affine_codes), bits, q8)
        c, s, o = (torch.cat(x).to(device) for x in zip(*(affine_codes(t.raw(), t.qtype) for t in run)))
        return Int4Part(c, s, o, dtype, split8=kind == "int8")
    if kind == "q6k":
        if TiledQ6KPart.usable(dtype, device, kernels):
            chunks = _row_chunks(run, device, lambda raw, qtype: q6_k_blocks(raw))
            return TiledQ6KPart.from_chunks(N, K, chunks, int8_activations=kernels.int8_activations)
        return Q6KPart.from_chunks(N, K, _row_chunks(run, device, lambda raw, qtype: q6_k_codes(raw)), dtype)
    return RawPart(torch.cat([t.raw() for t in run]).to(device), run[0].qtype, run[0].shape[1])


def _row_chunks(run: list, device, unpack):
    """unpack(raw, qtype) of the run's rows (its shards one after another), PACK_CHUNK_ROWS at a time
    (the last chunk may be short); a chunk that spans shards unpacks each piece and joins them."""
    total, at, rows = sum(t.shape[0] for t in run), 0, PACK_CHUNK_ROWS
    while at < total:
        pieces, start, want = [], 0, min(rows, total - at)
        for t in run:
            lo, hi = max(at, start), min(at + want, start + t.shape[0])
            if lo < hi:
                pieces.append(unpack(t.narrow(0, lo - start, hi - lo).raw().to(device), t.qtype))
            start += t.shape[0]
        yield pieces[0] if len(pieces) == 1 else tuple(torch.cat(x) for x in zip(*pieces))
        at += want


def _unordered(t: GGUFTensor) -> GGUFTensor:
    """The same blocks with their own column order (InputOrderPart applies the order)."""
    return GGUFTensor(t.qtype, t.data, t.shape)


def register_parts(module: nn.Module, parts: list[PackedPart], name: str = "") -> None:
    """Make the parts' tensors buffers of `module` (so they are counted with the weights)."""
    for i, part in enumerate(parts):
        for j, t in enumerate(part.buffers()):
            module.register_buffer(f"gguf_{name}_{i}_{j}" if name else f"gguf_{i}_{j}", t, persistent=False)


def apply_parts(parts: list[PackedPart], x: torch.Tensor) -> torch.Tensor:
    """x @ W^T for the rows the parts cover, in order."""
    return parts[0].linear(x) if len(parts) == 1 else torch.cat([p.linear(x) for p in parts], dim=-1)


def _check_shape(t, want: tuple[int, int], what: str) -> None:
    if tuple(t.shape) != want:
        raise ModelLoadError(
            f"{what} has shape {tuple(t.shape)} but the model expects {want}; the checkpoint does not match its config"
        )


# ---- Linear ---------------------------------------------------------------------------------


class GGUFLinearMethod(QuantMethod):
    """Shards are held as loaded until process_weights_after_loading packs the layer's parts.

    `weight` stays an empty placeholder Parameter: the model's loader finds layers by that name
    and checks shard completeness against it; the data lives in the parts' buffers."""

    def __init__(self, kernels: CpuKernels | None = None):
        self.kernels = kernels or CpuKernels()

    def create_weights(self, layer, in_features, out_features_per_shard, dtype, device):
        layer.weight = new_param((0,), dtype, device, output_dim=0, input_dim=1)
        layer.gguf_dtype, layer.gguf_device = dtype, torch.device(device)
        layer.gguf_pending, layer.gguf_parts = {}, []

    def load_weight(self, layer, param_name, tensor, shard_id):
        what = param_name if shard_id is None else f"{param_name} shard {shard_id!r}"
        _check_shape(tensor, (layer.shard_sizes[shard_id], layer.in_features), what)
        layer.gguf_pending[shard_id] = tensor  # a view of the file's map until packed

    def process_weights_after_loading(self, layer):
        if not layer.gguf_pending:
            return
        shards = [layer.gguf_pending.pop(s) for s in layer.shard_ids]
        layer.gguf_parts = pack_shards(shards, layer.gguf_dtype, layer.gguf_device, kernels=self.kernels)
        register_parts(layer, layer.gguf_parts)

    def apply(self, layer, x, bias=None):
        if layer.gguf_pending:  # a model built without the loader's post-load hook
            self.process_weights_after_loading(layer)
        y = apply_parts(layer.gguf_parts, x)
        return y if bias is None else y + bias

    def dense_weight(self, layer) -> torch.Tensor | None:
        """W [N, K] in float32 for a dense copy (ember.quant.weight_copies); None if it is dense already."""
        if layer.gguf_pending:
            self.process_weights_after_loading(layer)
        if all(isinstance(p, DensePart) for p in layer.gguf_parts):
            return None
        return torch.cat([p.dequantize() for p in layer.gguf_parts])


# ---- embedding / LM head ----------------------------------------------------------------------


class GGUFEmbeddingMethod:
    """Token embedding or untied LM head [V, H] as one packed part. The method holds the part,
    so a tied LM head that shares this method object reads the embedding's data (the head sets
    `serves_head`; an embedding that is only looked up may keep types with no int4 form raw)."""

    def __init__(self, serves_head: bool = False, kernels: CpuKernels | None = None):
        self.part: PackedPart | None = None
        self.serves_head = serves_head
        self.kernels = kernels or CpuKernels()

    def create_weights(self, module: nn.Module, vocab_size: int, hidden_size: int, dtype, device) -> None:
        module.weight = new_param((0,), dtype, device)
        self.shape, self.dtype, self.device = (vocab_size, hidden_size), dtype, torch.device(device)

    def load_weight(self, module: nn.Module, tensor) -> None:
        _check_shape(tensor, self.shape, "the embedding")
        (self.part,) = pack_shards([tensor], self.dtype, self.device, raw_ok=not self.serves_head, kernels=self.kernels)
        register_parts(module, [self.part])

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.part.rows(flat).to(self.dtype).view(*ids.shape, self.shape[1])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, H] -> float32 logits [n, V]."""
        y = self.part.linear_float(hidden)
        return y if self.part.precise_logits(hidden) else self.refine(y, hidden)

    def refine(self, y: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Low-precision logits y [n, V] with their leading candidates recomputed in float32."""
        n = hidden.shape[0]
        if gemm_dispatch.refine_logits(n):
            # bf16 logits keep ~3 digits (an ulp is 0.125 at 25), so near-ties at the top would be
            # settled by rounding: recompute the leading candidates in float32 from their rows.
            idx = cpu_row_top.topk_indices(y, min(REFINE_TOP_K, y.shape[1]))  # [n, k]
            w = self.part.rows(idx.reshape(-1)).view(n, idx.shape[1], -1)
            y.scatter_(1, idx, torch.bmm(w, hidden.float().unsqueeze(-1)).squeeze(-1))
        return y

    def dense_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """W [V, H] in dtype for a dense copy of the LM head, built PACK_CHUNK_ROWS rows at a time (no
        float32 copy of the whole table on the way); None if it is dense already."""
        if isinstance(self.part, DensePart):
            return None
        V, H = self.part.N, self.part.K
        w = torch.empty(V, H, dtype=dtype, device=self.device)
        for i in range(0, V, PACK_CHUNK_ROWS):
            ids = torch.arange(i, min(i + PACK_CHUNK_ROWS, V), device=self.device)
            w[i : i + len(ids)] = self.part.rows(ids)
        return w


# ---- MoE experts ------------------------------------------------------------------------------


class GGUFExperts(nn.Module):
    """E SwiGLU experts, each expert's gate;up and down packed like a GGUF Linear's shards (the
    loader hands out per-expert slices of the stacked 3-D tensors). Computes like moe.Experts.
    Where each of gate, up and down is GGUF blocks of one quantized type and the block kernel runs all three
    (on CPU: every quantized type), `block` holds the layer's raw blocks instead: gate, up [E, I, row_bytes],
    down [E, H, row_bytes], run by one block_moe call per step (types in `block_types`)."""

    _NAME = re.compile(r"^(\d+)\.(gate|up|down)_proj\.weight$")

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        dtype,
        device="cpu",
        kernels: CpuKernels | None = None,
    ):
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.dtype, self.device = dtype, torch.device(device)
        self.kernels = kernels or CpuKernels()
        # Empty placeholders: the model's loader checks shard completeness against w13 / w2.
        self.w13, self.w2 = new_param((0,), dtype, device), new_param((0,), dtype, device)
        self.pending: dict = {}
        self.parts13: list[list[PackedPart]] = []
        self.parts2: list[list[PackedPart]] = []
        self.block: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.block_types: tuple = ()
        self.graph_key = register_experts(self)

    def expected_shards(self, param_name: str) -> set:
        E = range(self.num_experts)
        return {(e, s) for e in E for s in ("gate", "up")} if param_name == "w13" else set(E)

    def load_weight(self, name: str, tensor, shard_id=None):
        m = self._NAME.match(name)
        if m is None:
            raise ModelLoadError(f"unexpected expert weight name {name!r}")
        e, kind = int(m[1]), m[2]
        if e >= self.num_experts:
            raise ModelLoadError(f"checkpoint has expert {e} but the config says num_experts={self.num_experts}")
        H, I = self.hidden_size, self.intermediate_size
        _check_shape(tensor, (H, I) if kind == "down" else (I, H), f"experts.{e}.{kind}_proj")
        self.pending[(e, kind)] = tensor
        return ("w2", e) if kind == "down" else ("w13", (e, kind))

    def pack(self) -> None:
        if self._pack_blocks():
            return
        for e in range(self.num_experts):
            gate_up = [self.pending.pop((e, "gate")), self.pending.pop((e, "up"))]
            self.parts13.append(pack_shards(gate_up, self.dtype, self.device, kernels=self.kernels))
            self.parts2.append(
                pack_shards([self.pending.pop((e, "down"))], self.dtype, self.device, kernels=self.kernels)
            )
            register_parts(self, self.parts13[-1], f"w13_{e}")
            register_parts(self, self.parts2[-1], f"w2_{e}")

    _KINDS = ("gate", "up", "down")

    def _pack_blocks(self) -> bool:
        """Stack the layer's raw blocks for block_moe where every expert's gate, up and down are GGUF blocks
        of one type each and the kernel runs all three: on CPU, every quantized type. One block_moe call a
        layer reads only the chosen experts, where the grouped path makes three small GEMV calls an expert (each
        an OpenMP region) plus the grouping's sort, host sync and scatter: docs/tuning.md has the timings."""
        from ember.quant import gguf_block_part

        E = self.num_experts
        shards = [[self.pending[(e, kind)] for e in range(E)] for kind in self._KINDS]
        if not all(isinstance(t, GGUFTensor) and t.input_order is None for ts in shards for t in ts):
            return False
        types = tuple(ts[0].qtype for ts in shards)
        if any(t.qtype != q for ts, q in zip(shards, types) for t in ts):
            return False
        if not all(gguf_block_part.usable(q, self.device, self.kernels) for q in types):
            return False
        stacked = []
        for kind, ts in zip(self._KINDS, shards):
            out = torch.empty((E, *ts[0].data.shape), dtype=torch.uint8, device=self.device)
            for e, t in enumerate(ts):
                out[e] = t.raw()  # one expert's copy at a time (its map pages released)
                del self.pending[(e, kind)]
            self.register_buffer(f"gguf_block_{kind}", out, persistent=False)
            stacked.append(out)
        self.block, self.block_types = tuple(stacked), types
        return True

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        if self.block is not None:
            from ember.kernels import cpu_block_gemv

            (g, u, d), (tg, tu, td) = self.block, self.block_types
            xb = _block_x(x)
            gu = torch.cat((cpu_block_gemv.gemm(xb, g[e], tg), cpu_block_gemv.gemm(xb, u[e], tu)), dim=-1)
            h = silu_and_mul(gu, self.kernels.fused_elementwise)
            return cpu_block_gemv.gemm(h.contiguous(), d[e], td).to(x.dtype)
        return apply_parts(
            self.parts2[e], silu_and_mul(apply_parts(self.parts13[e], x), self.kernels.fused_elementwise)
        )

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.pending:  # a model built without the loader's post-load hook
            self.pack()
        if self.block is not None:  # one op, no host sync: eager and in a graph alike
            from ember.kernels import cpu_block_gemv

            y = cpu_block_gemv.moe(_block_x(x), topk_ids, topk_weights, *self.block, self.block_types)
            return y.to(x.dtype)
        return experts_forward(self, x, topk_ids, topk_weights)


def _block_x(x: torch.Tensor) -> torch.Tensor:
    """x as the block kernels take it: float32 or bf16 rows, contiguous."""
    return (x if x.dtype in (torch.float32, torch.bfloat16) else x.float()).contiguous()


class GGUFExpertsMethod:
    def create_experts(self, num_experts, hidden_size, intermediate_size, dtype, device, kernels=None):
        experts = GGUFExperts(num_experts, hidden_size, intermediate_size, dtype, device, kernels)
        experts.quant_method = self  # so ember.quant.process_weights_after_loading calls the hook below
        return experts

    def process_weights_after_loading(self, experts: GGUFExperts) -> None:
        if experts.pending:
            experts.pack()


class GGUFConfig(QuantConfig):
    name = "gguf"

    def linear_method(self, prefix: str):
        return GGUFLinearMethod(self.kernels)

    def experts_method(self, prefix: str):
        return GGUFExpertsMethod()

    def embedding_method(self, prefix: str):
        return GGUFEmbeddingMethod(serves_head=prefix.endswith("lm_head"), kernels=self.kernels)
