"""What the Triton attention kernels share: interpreter detection, dot precision, a fix for two
casts the interpreter gets wrong, the launchers' layout check and strides, and the kernels' common
steps (a sequence's extent, the query tile, the online softmax over paged key tiles, the output store).

These modules import triton at the top and define their kernels at module level (helpers such
as round_to_format are called from kernels, and the interpreter resolves a kernel's callees in
its module's globals, not in closures). @triton.jit reads TRITON_INTERPRET when a function is
decorated, and the kernels use tl.max / tl.sum, which triton decorates when it is imported: so
the variable must be set before triton is first imported (the tests set it in
tests/kernels/conftest.py) and cannot change afterwards; check_launch says so when it did.
Only TritonAttentionBackend's users import these modules, never ember on a plain CPU run.

Interpreter gaps (triton 3.9), and how the kernels stay honest about them:
  - tl.dot on bfloat16 multiplies the raw uint16 bits: under the interpreter every dot runs on
    fp32-cast inputs (DOT_FP32); on a GPU fp16/bf16 inputs go to tl.dot as they are.
  - fp32 -> bf16 truncates instead of rounding, and fp32 -> fp8 rounds without carrying into
    the exponent (31.7 -> 16 instead of 32 in e4m3). So under the interpreter a value is first
    rounded to nearest-even in fp32 (round_to_format); the cast then only drops zero bits and
    gives exactly what torch (and the GPU) gives. On a GPU the cast is used directly.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ember.errors import ConfigError

# (mantissa bits, smallest normal) of the formats whose interpreter cast needs pre-rounding.
# smallest normal 0.0: the format's subnormals are fp32's (bf16), no separate rounding step.
_ROUNDED_FORMATS = {
    torch.bfloat16: (7, 0.0),
    torch.float8_e4m3fn: (3, 2.0**-6),
    torch.float8_e5m2: (2, 2.0**-14),
}


def interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETING = interpret()  # how this process's kernels were built (see the module docstring)


def check_launch(*tensors: torch.Tensor) -> None:
    """The kernels run on CUDA tensors, or on CPU tensors under the interpreter."""
    if interpret() != INTERPRETING:
        raise ConfigError(
            "TRITON_INTERPRET changed after ember's Triton kernels were built; set it before "
            "the first import of triton (and of ember.kernels.triton_*)"
        )
    on_cpu = any(t.device.type == "cpu" for t in tensors)
    if on_cpu and not INTERPRETING:
        raise ConfigError(
            "the Triton attention kernels run on CUDA tensors; on CPU use --attention-backend torch "
            "(or set TRITON_INTERPRET=1 before starting, to run them in Triton's interpreter)"
        )


def check_paged_layout(q: torch.Tensor, kv_cache: torch.Tensor, kernel: str) -> None:
    """The layout the attention kernels index by: unit-stride head dims, and cache blocks laid out one
    after the other (slot = block * block_size + offset, one stride for both)."""
    block_size = kv_cache.shape[2]
    if q.stride(2) != 1 or kv_cache.stride(4) != 1 or kv_cache.stride(1) != block_size * kv_cache.stride(2):
        raise ValueError(f"{kernel} needs unit-stride head dims and a cache with contiguous blocks")


def paged_strides(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor) -> tuple[int, ...]:
    """(stride_qt, stride_qh, stride_kv, stride_slot, stride_kvh, stride_bt), in the order the attention
    kernels take them: query token and head; K to V, slot (the block dim folded in) and kv head of the
    cache; a block-table row."""
    return q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cast_constexprs(dtype: torch.dtype, interpreting: bool) -> dict:
    """ROUND_MBITS / ROUND_MIN_NORMAL for round_to_format: 0 = cast directly."""
    if not interpreting or dtype not in _ROUNDED_FORMATS:
        return dict(ROUND_MBITS=0, ROUND_MIN_NORMAL=0.0)
    mbits, min_normal = _ROUNDED_FORMATS[dtype]
    return dict(ROUND_MBITS=mbits, ROUND_MIN_NORMAL=min_normal)


def dot_precision(dtype: torch.dtype, interpreting: bool) -> tuple[bool, str | None]:
    """(DOT_FP32, input_precision): fp32 dots in fp32 ("ieee", as the fp32 reference), half
    types as they are on a GPU; everything in fp32 under the interpreter (see above)."""
    if interpreting or dtype == torch.float32:
        return True, "ieee"
    return False, None


@triton.jit
def round_to_format(x, ROUND_MBITS: tl.constexpr, ROUND_MIN_NORMAL: tl.constexpr):
    """fp32 x rounded to nearest-even at ROUND_MBITS mantissa bits (the carry may bump the
    exponent); below ROUND_MIN_NORMAL (a subnormal range with a fixed step) to that step.
    ROUND_MBITS 0: x unchanged (every GPU launch; the branch is not even compiled)."""
    y = x
    if ROUND_MBITS != 0:
        SHIFT: tl.constexpr = 23 - ROUND_MBITS
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)) & (-(1 << SHIFT))
        y = bits.to(tl.float32, bitcast=True)
        if ROUND_MIN_NORMAL != 0.0:
            step = ROUND_MIN_NORMAL / (1 << ROUND_MBITS)
            # adding 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to an integer, ties to even
            # (on |x|, then the sign again: a tiny negative value must round to -0.0, as in torch)
            sub = ((tl.abs(x) / step + 12582912.0) - 12582912.0) * step
            y = tl.where(tl.abs(x) < ROUND_MIN_NORMAL, tl.where(x < 0, -sub, sub), y)
    return y


@triton.jit
def attend_key_tile(
    q,
    acc,
    m_i,
    l_i,
    start,
    hi,
    visible_end,
    kv_base,
    bt_row_ptr,
    d_ok,
    qk_scale,
    stride_kv,
    stride_slot,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One flash-attention step: the BLOCK_N keys from position start (those < hi) of one
    sequence, gathered slot by slot from its block table row (key position p lives in slot
    bt_row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE, so a tile may span cache blocks),
    scored against the query tile q [M, D_PAD] (scores base 2), masked per row to keys <
    visible_end, and folded into the running max m_i, sum l_i and accumulator acc.
    Returns (acc, m_i, l_i). K/V widen to q's dtype (fp8 exactly; the scales are folded by the
    callers). The decode and the prefill kernel differ only in which query rows and keys they
    walk, so both run their key loops through this."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < hi
    block = tl.load(bt_row_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + keys % BLOCK_SIZE
    kv_mask = key_ok[:, None] & d_ok[None, :]
    k = tl.load(kv_base + slot[:, None] * stride_slot, mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(kv_base + stride_kv + slot[:, None] * stride_slot, mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(key_ok[None, :] & (keys[None, :] < visible_end[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet: no NaN
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# -- the attention kernels' shared steps (jitted callees are inlined into the kernel that calls them) --


@triton.jit
def sequence_extent(qsl_ptr, seq_lens_ptr, b):
    """(first query token, query length, sequence length) of sequence b of a varlen step."""
    q_start = tl.load(qsl_ptr + b)
    q_len = tl.load(qsl_ptr + b + 1) - q_start
    return q_start, q_len, tl.load(seq_lens_ptr + b)


@triton.jit
def load_query_tile(q_ptrs, mask, DOT_FP32: tl.constexpr):
    """The query tile at q_ptrs (0 where masked), widened to fp32 when the dots run in fp32."""
    q = tl.load(q_ptrs, mask=mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    return q


@triton.jit
def fold_k_scale(qk_scale, k_scale_ptr, FP8: tl.constexpr):
    """The score scale, times an fp8 cache's k_scale: K loads unscaled, so the scale goes on the scores."""
    if FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    return qk_scale


@triton.jit
def attend_keys(
    q,
    lo,
    hi,
    visible_end,
    kv_base,
    bt_row_ptr,
    d_ok,
    qk_scale,
    stride_kv,
    stride_slot,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The query tile q [M, D_PAD] over the keys at positions lo..hi-1, BLOCK_N at a time
    (attend_key_tile): (acc, m_i, l_i), acc not yet divided by l_i; a row that saw no key keeps l_i 0."""
    m_i = tl.full((q.shape[0],), float("-inf"), tl.float32)
    l_i = tl.full((q.shape[0],), 0.0, tl.float32)
    acc = tl.full(q.shape, 0.0, tl.float32)
    for start in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = attend_key_tile(
            q,
            acc,
            m_i,
            l_i,
            start,
            hi,
            visible_end,
            kv_base,
            bt_row_ptr,
            d_ok,
            qk_scale,
            stride_kv,
            stride_slot,
            BLOCK_SIZE,
            BLOCK_N,
            PRECISION,
        )
    return acc, m_i, l_i


@triton.jit
def store_output(
    out_ptr, offsets, o, mask, v_scale_ptr, FP8: tl.constexpr, ROUND_MBITS: tl.constexpr, ROUND_MIN_NORMAL: tl.constexpr
):
    """The fp32 attention output o into out (at out_ptr + offsets) in out's dtype: times an fp8 cache's
    v_scale (V loads unscaled; the softmax weights sum to 1, so the scale goes on the output), rounded
    before the cast where the interpreter needs it (round_to_format)."""
    if FP8:
        o = o * tl.load(v_scale_ptr)
    o = round_to_format(o, ROUND_MBITS, ROUND_MIN_NORMAL)
    tl.store(out_ptr + offsets, o.to(out_ptr.dtype.element_ty), mask=mask)
