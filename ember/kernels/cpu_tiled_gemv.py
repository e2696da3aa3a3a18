"""x @ W^T on CPU over 4- and 8-bit affine weights, in row tiles (cpu_tiled_gemv.cpp).

Why: batch-1 decode is nothing but GEMVs over the packed weights, and torch's CPU int4 kernel
(aten._weight_int4pack_mm_for_cpu) leaves much of the memory bandwidth unused (docs/tuning.md,
"CPU kernels", has the figures of each step below). This kernel keeps 16 output rows in the
16 float32 lanes of an AVX-512 register: a bf16 dot instruction (vdpbf16ps) multiplies 16 rows'
codes at two inputs by a broadcast pair of x, with no dequantized weight and no horizontal
sums; a group's scale and offset are applied once per 16 x 32 tile. Numerics: the codes and
x (bf16) are exact in the products, sums are float32 -- the torch kernel instead rounds its
(scale, zero) to bf16.

Layout (`pack`): codes uint8 [N/16, K/32, 256] (4-bit: two codes a byte) or [N/16, K/32, 512]
(8-bit), scale and offset [N/16, K/32, 16] in float16 where that holds them exactly (GGUF's
Q4_0, Q4_1, Q8_0 block scales are float16), else float32. N is padded to a multiple of 16. Q4_K /
Q5_K may keep their two levels instead (`pack_k`, both builds: 6-bit sc and m per 32 as uint8
[N/16, K/32, 2, 16], float16 d and dmin per 256 as [N/16, K/256, 2, 16]; the kernel forms d sc and
-dmin m per group, exact in float32: the flat float32 values, bit for bit, in 0.078 B a weight of
scales instead of 0.25).

On CPUs with AVX2, FMA and F16C but no AVX-512 BF16 (Zen2/Zen3, Haswell on), where the engine
runs in float32, the same tiles serve a float32-x build that multiplies in integers: each group of
32 inputs of x is held as int16 steps of the group's largest |x| (rounding moves an x by at most
2^-16 of that: finer than the bf16 x of the AVX-512 build), codes times those are summed exactly in
int32 with vpmaddwd (16 products an instruction), and the group's scale, step and offset apply in
float32. It replaced an exact-float32 build (codes spread to float32 and FMA'd with a broadcast x,
compute-bound) at the same greedy output and top-5 logprobs within a few thousandths; one step per
row of x (its first form) moved logits too much.
From 16 rows of x (prefill, batched decode) that build widens each tile's codes to int16 once and
runs 3 rows of x a pass against them with 6 registers of int32 sums (the few-row loop re-widens
per 4 rows and spills). Same products, same epilogue: the same bits as the few-row path. It beats
MKL's float32 GEMM over the dequantized weight at every row count measured, so the AVX2 build serves
every row count and needs no dense copy. Where the compiler targets AVX-VNNI (-march=native on Intel's
12th gen on), vpdpwssd does vpmaddwd + vpaddd's work in one instruction: the same int32 sums, so the
same bits (an -march=haswell -mavxvnni build passes this module's tests), ~10-17% faster (docs/tuning.md).
Many rows in the bf16 build (gemm_q8; CPUs with AVX-512 VNNI and VBMI: Zen4, Sapphire Rapids): from
TILED_Q8_MIN_ROWS (ember.quant.gemm_dispatch) rows of x (prefill, batched decode), each group of 32 inputs of a row is rounded to int8
steps of the group's largest |x| (step = max|x| / 127: llama.cpp's Q8 activation blocks, which its
and vLLM's GGUF kernels multiply Q4/Q8 weights by), and vpdpbusd sums unsigned codes times those
int8 steps exactly in int32, 64 products an instruction (vdpbf16ps: 32); scale * step and offset *
step * sum(q) apply per group in float32. One vpermb per 64 tile bytes turns the tile's pairs into
the 4-code lanes vpdpbusd takes, so the layout is the GEMV's and no dense copy is needed. The
float32 epilogue per group (convert, scale, two FMAs against 8 vpdpbusd) shares their pipes: ~65%
of the int8 peak. It beats oneDNN's bf16 GEMM over a dense copy at every row count measured.
Numerics: the default model's perplexity on held-out text moves +0.3% (a per-row, not per-group,
int8 x moved it +2.3%).
Q6_K (`pack_q6k`, `gemv_q6k`, `gemm_q8_q6k`; ember.quant.gguf_quant.TiledQ6KPart), both builds:
the file's bits kept, 0.82 B a weight. A 384-byte tile is the 4-bit tile of the 6-bit codes' low
nibbles plus a 2-bit plane of their high bits, laid out so that one widened 32-byte run of the plane
lines up word for word with the two 4-bit runs it serves (a shift and a ternary-logic op put the two
bits beside the nibble: the bf16 of 128 + q6, as the 4-bit codes' 128 + c); the scales stay int8 S
per 16 inputs and float16 d per 256 (d * S is exact in float32: 11 x 8 bits; float16 per-16 scales
would not hold it, ~18 significant bits). Each half of a tile (inputs 0..15, 16..31) is a sub-block
and accumulates apart, from -160 sum(x) (GEMV) or -32 sum(q) (int8 x), so the offset costs no
extra multiply. Numerics are the 4/8-bit tiles': exact products summed in float32 (bf16 x), or x
rounded to int8 per group of 32 (many rows). The AVX2 build reads the same tiles (one packing for
both): the 6-bit codes widen to int16 exactly and vpmaddwd multiplies them by x's int16 steps, each
half of a tile summed apart in int32 (exactly sum((q6 - 32) q): from -32 sum(q) in the GEMV, from codes
widened as q6 - 32 in the many-row path, which it takes from 16 rows as the 4/8-bit tiles do; the same
bits either way), times d S and the step in float32. So an AVX2 machine runs a Q4_K_M file's Q6_K
linears and LM head on the file's own bits at every row count, with no dense copy (before: Q6KPart,
torch's int4 kernel in float32, ~50x slower than a float32 GEMV, and a float32 dense copy of the Q6_K
layers for many rows). Figures against Q6KPart (both builds): docs/tuning.md.
`x_dtype()` says which x this machine's build takes (None: neither),
`available()` whether it also built, `has_q8()` whether the int8-x path is there, `has_q6k()` the Q6_K tiles,
`has_k_scales()` the two-level K-quant scales. Built like the attention kernel (ember.kernels.cpp_build).
Which path a step takes by its row count (TILED_Q8_MIN_ROWS and the GEMV's max rows) is
ember.quant.gemm_dispatch's; whether a model uses the kernel at all is its CpuKernels'.
"""

from __future__ import annotations

import torch

from ember.kernels.cpp_build import build, has_cpu_flags

ROWS, GROUP = 16, 32
TILE_BYTES = {4: 256, 8: 512}
Q6K_TILE_BYTES, Q6K_SUPER = 384, 256  # a Q6_K tile: 4-bit low nibbles + 2-bit high plane; a K-quant superblock


def x_dtype() -> torch.dtype | None:
    """The activation dtype of this machine's build: bf16 with AVX-512 BF16, float32 with AVX2."""
    if has_cpu_flags("avx512f", "avx512bw", "avx512_bf16"):
        return torch.bfloat16
    if has_cpu_flags("avx2", "fma", "f16c"):
        return torch.float32
    return None


def rounds_x() -> bool:
    """True where this machine's build rounds float32 x to int16 steps (the AVX2 build): its
    outputs differ from an exact float32 GEMV by up to rounding_bound()."""
    return x_dtype() == torch.float32


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[M, N]: the most the AVX2 build's rounding of x [M, K] moves x @ w^T (w [N, K] the dequantized
    weight): sum over k of |w[n, k]| times half a step of x's group of k (step = the group's largest
    |x| / 32767). Zero where x is used as is (the bf16 build)."""
    if not rounds_x():
        return x.new_zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    M, K = x.shape
    half_step = x.double().view(M, K // GROUP, GROUP).abs().amax(dim=2, keepdim=True) / 32767 / 2
    return half_step.expand(M, K // GROUP, GROUP).reshape(M, K) @ w.double().abs().t()


def has_q8() -> bool:
    """True where this machine's build has the int8-x many-row path (gemm_q8): AVX-512 BF16 with
    VNNI and VBMI (Zen4, Sapphire Rapids)."""
    return x_dtype() == torch.bfloat16 and has_cpu_flags("avx512_vnni", "avx512vbmi")


def has_k_scales() -> bool:
    """True where this machine's build takes Q4_K / Q5_K's two-level scales as they are (pack_k): both
    builds (AVX-512 BF16, AVX2)."""
    return x_dtype() is not None


def has_q6k() -> bool:
    """True where this machine's build has the Q6_K tiles (gemv_q6k, in x_dtype() at any row count): both
    builds. Their int8-x path (gemm_q8_q6k) wants has_q8() as well."""
    return x_dtype() is not None


def available() -> bool:
    """True when the op can run here (loaded; built once first where it was not built at install)."""
    return (
        x_dtype() is not None
        and build(
            "cpu_tiled_gemv.cpp",
            fakes={
                "ember_cpu::tiled_gemv": _fake_gemv,
                "ember_cpu::tiled_gemm_q8": _fake_gemv,
                "ember_cpu::tiled_q6k_gemv": _fake_q6k,
                "ember_cpu::tiled_q6k_gemm_q8": _fake_q6k,
            },
        )
        is not None
    )


def _fake_gemv(x, codes, scale, offset, bits, float_out):
    """Shapes for torch.compile's tracing: the op is an opaque call in a compiled graph."""
    return x.new_empty((x.shape[0], codes.shape[0] * ROWS), dtype=torch.float32 if float_out else x.dtype)


def _fake_q6k(x, tiles, sub_scale, d, float_out):
    return x.new_empty((x.shape[0], tiles.shape[0] * ROWS), dtype=torch.float32 if float_out else x.dtype)


def _tile_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [N, K] (N a multiple of 16) -> uint8 tiles [N/16, K/32, TILE_BYTES[bits]]."""
    N, K = codes.shape
    T, G = N // ROWS, K // GROUP
    c = codes.to(torch.uint8).view(T, ROWS, G, GROUP).permute(0, 2, 1, 3)  # [T, G, i, k]
    if bits == 4:  # k = 16 h + 2 p + e -> byte 32 p + 2 i + e, nibble h
        c = c.reshape(T, G, ROWS, 2, 8, 2).permute(0, 1, 3, 4, 2, 5)  # [T, G, h, p, i, e]
        return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(T, G, TILE_BYTES[4]).contiguous()
    # k = 2 p + e -> byte 32 p + 2 i + e
    return c.reshape(T, G, ROWS, 16, 2).permute(0, 1, 3, 2, 4).reshape(T, G, TILE_BYTES[8]).contiguous()


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int):
    """W[n, k] = codes[n, k] * scale[n, k // 32] + offset[n, k // 32] -> (tiles, scale, offset)
    in the kernel's layout. codes: integers below 2**bits, [N, K] with K % 32 == 0."""
    N, K = codes.shape
    if K % GROUP or bits not in TILE_BYTES:
        raise ValueError(f"tiled GEMV needs K % {GROUP} == 0 and 4 or 8 bits (got K={K}, bits={bits})")
    pad = -N % ROWS
    if pad:
        codes, scale, offset = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (codes, scale, offset))
    T, G = (N + pad) // ROWS, K // GROUP
    tiles = _tile_codes(codes, bits)
    s, o = scale.float(), offset.float()
    dtype = torch.float16 if torch.equal(s.half().float(), s) and torch.equal(o.half().float(), o) else torch.float32
    s, o = (t.to(dtype).view(T, ROWS, G).transpose(1, 2).contiguous() for t in (s, o))
    return tiles, s, o


def pack_k(codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor, bits: int):
    """Q4_K / Q5_K's W = d sc code - dmin m per group of 32 -> (tiles, scale, offset) with the file's two
    levels of scales kept (gguf_blocks.k_quant_fields: sc, m uint8 per 32; d, dmin float16 per 256):
    scale uint8 [N/16, K/32, 2, 16] (sc, m), offset float16 [N/16, K/256, 2, 16] (d, dmin); the kernel
    takes these in place of flat ones (has_k_scales), 2 B + 4 B / 8 per 32 weights against 8 B of float32
    (d sc needs ~17 significant bits: float16 cannot hold it). N is padded to a multiple of 16."""
    N, K = codes.shape
    if K % Q6K_SUPER or bits not in TILE_BYTES:
        raise ValueError(f"K-quant scales need K % {Q6K_SUPER} == 0 and 4 or 8 bits (got K={K}, bits={bits})")
    pad = -N % ROWS
    if pad:
        codes, sc, m, d, dmin = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (codes, sc, m, d, dmin))
    T, G = (N + pad) // ROWS, K // GROUP
    tiles = _tile_codes(codes, bits)
    sm = torch.stack((sc, m), dim=-1).to(torch.uint8).view(T, ROWS, G, 2).permute(0, 2, 3, 1).contiguous()
    dd = torch.stack((d, dmin), dim=-1).to(torch.float16).view(T, ROWS, -1, 2).permute(0, 2, 3, 1).contiguous()
    return tiles, sm, dd


def _k_flat(sm: torch.Tensor, dd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K-quant scales [..., G, 2] (sc, m) and [..., B, 2] (d, dmin) -> flat float32 scale and offset
    [..., G]: d sc and -dmin m, exact."""
    ddf = dd.float().repeat_interleave(Q6K_SUPER // GROUP, dim=-2)  # a superblock of 256 is 8 groups
    return ddf[..., 0] * sm[..., 0].float(), -(ddf[..., 1] * sm[..., 1].float())


def flat_scales(scale: torch.Tensor, offset: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Any store -> float32 scale and offset [N/16, K/32, 16] (flat ones as they are, K-quants' computed)."""
    if scale.dtype != torch.uint8:
        return scale.float(), offset.float()
    s, o = _k_flat(scale.permute(0, 3, 1, 2), offset.permute(0, 3, 1, 2))  # [T, 16, G or B, 2] -> [T, 16, G]
    return s.transpose(1, 2), o.transpose(1, 2)


def pack_q6k(q6: torch.Tensor, sub_scale: torch.Tensor, d: torch.Tensor):
    """Q6_K's w = d * S * (q6 - 32) -> (tiles, sub_scale, d) in the kernel's Q6_K layout (the .cpp's
    "Q6_K tiles"). q6: codes 0..63 [N, K], K % 256 == 0; sub_scale: int8 S [N, K/16]; d: float16
    [N, K/256] (gguf_blocks.q6_k_blocks). Tiles uint8 [N/16, K/32, 384] (the 4-bit tile of the low
    nibbles, then the 2-bit plane), sub_scale int8 [N/16, K/32, 2, 16], d float16 [N/16, K/256, 16];
    N is padded to a multiple of 16 with zero rows. Nothing rounds: 0.82 B a weight, the file's."""
    N, K = q6.shape
    if K % Q6K_SUPER:
        raise ValueError(f"Q6_K tiles need K % {Q6K_SUPER} == 0 (got K={K})")
    pad = -N % ROWS
    if pad:
        q6, sub_scale, d = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q6, sub_scale, d))
    T, G = (N + pad) // ROWS, K // GROUP
    q6 = q6.to(torch.uint8)
    low = _tile_codes(q6 & 15, 4)
    # k = 16 h + 2 p + e with p = 2 r + u -> plane byte 32 r + 2 i + e, bits 4 u + 2 h
    hi = (q6 >> 4).view(T, ROWS, G, 2, 4, 2, 2).permute(0, 2, 4, 1, 6, 5, 3)  # [T, G, r, i, e, u, h]
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8, device=q6.device)  # [u, h]
    plane = (hi << shifts).sum(dim=(-2, -1), dtype=torch.uint8).reshape(T, G, 128)  # disjoint bits: sum = or
    tiles = torch.cat((low, plane), dim=2).contiguous()
    sub = sub_scale.to(torch.int8).view(T, ROWS, G, 2).permute(0, 2, 3, 1).contiguous()  # [T, G, h, i]
    dd = d.to(torch.float16).view(T, ROWS, K // Q6K_SUPER).transpose(1, 2).contiguous()  # [T, B, i]
    return tiles, sub, dd


def _q6k_values(low: torch.Tensor, plane: torch.Tensor, sub: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Rows of W from their tile bytes, float32 [n, K] exactly d * S * (q6 - 32): low uint8 [n, G, p, e]
    (one row's bytes of each 4-bit run), plane uint8 [n, G, r, e], sub int8 [n, G, 2], d float16 [n, B].
    The scale d * S is exact in float32 (11 x 8 bits) and so is its product with q6 - 32 (6 more)."""
    n, G = low.shape[:2]
    lo = torch.stack((low & 15, low >> 4), dim=2)  # [n, G, h, p, e]
    # bit pair (h, u) of a plane byte sits at shift 2 h + 4 u; built from shifts by constants, not from a
    # tensor of them: a lookup in a traced step must hold no tensor of its own (an ahead-of-time package
    # could not find it on the model)
    a = plane.view(n, G, 4, 2)  # [n, G, r, e]
    hi = torch.stack([torch.stack([(a >> (2 * h + 4 * u)) & 3 for u in (0, 1)], dim=3) for h in (0, 1)], dim=2)
    q6 = lo.reshape(n, G, 2, 16) | (hi.reshape(n, G, 2, 16) << 4)
    c = d.float().repeat_interleave(Q6K_SUPER // GROUP, dim=1).unsqueeze(-1) * sub.float()  # [n, G, 2]
    return ((q6.float() - 32) * c.unsqueeze(-1)).view(n, G * GROUP)


def unpack_rows_q6k(tiles: torch.Tensor, sub_scale: torch.Tensor, d: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of a Q6_K matrix as float32 [len(ids), K], exactly d * S * (q6 - 32) (gguf-py's values)."""
    t, i = ids // ROWS, ids % ROWS
    T, G, _ = tiles.shape
    low = tiles[:, :, : TILE_BYTES[4]].view(T, G, 8, ROWS, 2)[t, :, :, i]  # [n, G, p, e]: only that row's bytes
    plane = tiles[:, :, TILE_BYTES[4] :].view(T, G, 4, ROWS, 2)[t, :, :, i]  # [n, G, r, e]
    return _q6k_values(low, plane, sub_scale[t, :, :, i], d[t, :, i])


def dequantize_q6k(
    tiles: torch.Tensor, sub_scale: torch.Tensor, d: torch.Tensor, dtype: torch.dtype, N: int | None = None
) -> torch.Tensor:
    """W [N, K] of a Q6_K matrix in `dtype` (the first N rows; default all, padding included)."""
    T, G, _ = tiles.shape
    n = T * ROWS
    low = tiles[:, :, : TILE_BYTES[4]].view(T, G, 8, ROWS, 2).permute(0, 3, 1, 2, 4).reshape(n, G, 8, 2)
    plane = tiles[:, :, TILE_BYTES[4] :].view(T, G, 4, ROWS, 2).permute(0, 3, 1, 2, 4).reshape(n, G, 4, 2)
    sub = sub_scale.permute(0, 3, 1, 2).reshape(n, G, 2)
    dd = d.transpose(1, 2).reshape(n, -1)
    return _q6k_values(low, plane, sub, dd)[:N].to(dtype)


def unpack_rows(
    tiles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, ids: torch.Tensor
) -> torch.Tensor:
    """Rows `ids` of W as float32 [len(ids), K], exactly codes * scale + offset."""
    t, i = ids // ROWS, ids % ROWS
    T, G, _ = tiles.shape
    n = len(ids)
    # tile t, row i: only that row's bytes are gathered (indexing whole tiles first copied 16 rows per id)
    if bits == 4:
        b = tiles.view(T, G, 8, ROWS, 2)[t, :, :, i]  # [n, G, p, e]
        c = torch.stack((b & 15, b >> 4), dim=2)  # [n, G, h, p, e]
    else:
        c = tiles.view(T, G, 16, ROWS, 2)[t, :, :, i]  # [n, G, p, e]
    c = c.reshape(n, G, GROUP).float()
    if scale.dtype == torch.uint8:  # K-quant scales: [n, G, 2] (sc, m) and [n, B, 2] (d, dmin)
        s, o = (v.unsqueeze(-1) for v in _k_flat(scale[t, :, :, i], offset[t, :, :, i]))
    else:
        s = scale[t, :, i].float().unsqueeze(-1)  # [n, G, 1]
        o = offset[t, :, i].float().unsqueeze(-1)
    return (c * s + o).view(n, G * GROUP)


def dequantize(
    tiles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, dtype: torch.dtype, N: int | None = None
) -> torch.Tensor:
    """W [N, K] in `dtype` (the first N rows; default all, padding included)."""
    T, G, _ = tiles.shape
    if bits == 4:
        b = tiles.view(T, G, 8, ROWS, 2)
        c = torch.stack((b & 15, b >> 4), dim=2).permute(0, 4, 1, 2, 3, 5)  # [T, i, G, h, p, e]
    else:
        c = tiles.view(T, G, 16, ROWS, 2).permute(0, 3, 1, 2, 4)  # [T, i, G, p, e]
    w = c.reshape(T * ROWS, G, GROUP).to(dtype)
    if scale.dtype == torch.uint8:  # K-quant scales, as float32 first (dtype may not hold d sc exactly)
        scale, offset = flat_scales(scale, offset)
    w = w * scale.transpose(1, 2).reshape(T * ROWS, G, 1).to(dtype) + offset.transpose(1, 2).reshape(T * ROWS, G, 1).to(
        dtype
    )
    return w.view(T * ROWS, G * GROUP)[:N]


def gemv(
    x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, float_out: bool = False
) -> torch.Tensor:
    """x [M, K] in x_dtype() -> x @ W^T [M, N padded to 16] (x's dtype, or float32 with float_out)."""
    return torch.ops.ember_cpu.tiled_gemv(x, tiles, scale, offset, bits, float_out)


def gemm_q8(
    x: torch.Tensor, tiles: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int, float_out: bool = False
) -> torch.Tensor:
    """x [M, K] bf16 -> x' @ W^T [M, N padded to 16], x' = x quantized to int8 per group of 32 (see
    q8_reference). Where has_q8()."""
    return torch.ops.ember_cpu.tiled_gemm_q8(x, tiles, scale, offset, bits, float_out)


def gemv_q6k(
    x: torch.Tensor, tiles: torch.Tensor, sub_scale: torch.Tensor, d: torch.Tensor, float_out: bool = False
) -> torch.Tensor:
    """x [M, K] in x_dtype() -> x @ W^T [M, N padded to 16] over Q6_K tiles (pack_q6k), in x's dtype or
    float32 with float_out (the AVX2 build: float32 either way). Where has_q6k()."""
    return torch.ops.ember_cpu.tiled_q6k_gemv(x, tiles, sub_scale, d, float_out)


def gemm_q8_q6k(
    x: torch.Tensor, tiles: torch.Tensor, sub_scale: torch.Tensor, d: torch.Tensor, float_out: bool = False
) -> torch.Tensor:
    """The same with x rounded to int8 per group of 32 (q8_reference), as gemm_q8. Where has_q8()."""
    return torch.ops.ember_cpu.tiled_q6k_gemm_q8(x, tiles, sub_scale, d, float_out)


def q8_reference(x: torch.Tensor) -> torch.Tensor:
    """The x gemm_q8 multiplies, as float64: each group of 32 inputs of a row rounded to int8 steps of
    the group's largest |x| (step = max|x| / 127), as the kernel does."""
    M, K = x.shape
    xg = x.float().view(M, K // GROUP, GROUP)
    amax = xg.abs().amax(dim=2, keepdim=True)
    # a true float32 division, as the kernel's (127.0 / t would be reciprocal(t) * 127: another
    # rounding, which moves the exact ties that bf16 x makes at x * inv = k + 0.5)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax), torch.zeros_like(amax))
    q = torch.round(xg * inv).clamp(-127, 127)  # round half to even, as the kernel's cvtps2dq
    return (q.double() * (amax.double() / 127)).view(M, K)
