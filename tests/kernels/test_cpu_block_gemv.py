"""The block GEMV over a GGUF file's own blocks (ember/kernels/cpu_block_gemv.*): each type's row dequantizer
against gguf-py's reference bit for bit on random valid blocks; the GEMM (SIMD dots, 4-row dots, K chunks,
M blocks, threads) and the scalar reference dots against dequant(w) @ x as the kernel rounds it, at odd shapes,
strided views and bf16 / float32 x; the routed MoE op against a torch reference; the refusals; and the AVX2
build on this machine's tests. The grid-coded IQ types are cpu_block_gemv_iq's (their own tests); here they
only show up in the registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from ember.kernels import cpu_block_gemv as bg
from ember.kernels.cpp_build import has_cpu_flags
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(not bg.available(), reason="needs a C++ compiler")

TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ4_NL, T.IQ4_XS]
IQ_GRID = [T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M]
# byte offsets of each type's float16 scales in a block (random bytes elsewhere are valid codes)
F16_AT = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q6_K: (208,), T.Q4_1: (0, 2), T.Q5_1: (0, 2), T.Q4_K: (0, 2)}
F16_AT[T.Q5_K] = (0, 2)


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes] of random blocks with finite float16 scales (some negative, some tiny)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in F16_AT.get(qtype, (0,)):
        d = (rng.standard_normal(b.shape[:2]) * 10.0 ** rng.integers(-4, 1, b.shape[:2])).astype(np.float16)
        b[:, :, at : at + 2] = d.view(np.uint8).reshape(*b.shape[:2], 2)
    return b.reshape(rows, -1)


def reference(x: torch.Tensor, raw: np.ndarray, qtype: T) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequant(w) @ xq^T in float64, the same over |w| |xq|: the scale of float32 summation noise), xq being
    x as the kernel rounds it."""
    w = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32)).double()
    xq = bg.quantize_act(x.float(), qtype).double()
    return xq @ w.t(), xq.abs() @ w.abs().t()


def test_the_registry_has_every_type():
    assert set(TYPES + IQ_GRID) <= bg.types()
    assert not bg.supports(T.F16) and not bg.supports(T.TQ1_0)


@pytest.mark.parametrize("qtype", TYPES)
def test_dequant_rows_is_gguf_py_bit_for_bit(qtype):
    block = GGML_QUANT_SIZES[qtype][0]
    raw = random_blocks(qtype, 7, 3 * block if block == 256 else 5 * block, seed=int(qtype))
    ref = torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))
    ours = bg.dequant_rows(torch.from_numpy(raw), qtype)
    assert ours.dtype == torch.float32 and ours.shape == ref.shape
    assert torch.equal(ours.view(torch.int32), ref.view(torch.int32))  # signed zeros too


@pytest.mark.parametrize("qtype", TYPES)
def test_gemm_and_scalar_dots_give_the_products_of_the_rounded_x(qtype):
    """M = 1 (row dots), 3 (a 4-row dot with a row repeated), 6 (4-row dots, then 2), 70 (two M blocks); 13 rows
    (a short last tile)."""
    block = GGML_QUANT_SIZES[qtype][0]
    K = 2 * block if block == 256 else 9 * block
    raw = random_blocks(qtype, 13, K, seed=100 + int(qtype))
    w = torch.from_numpy(raw)
    for M in (1, 3, 6, 70):
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
        ref, scale = reference(x, raw, qtype)
        for y in (bg.gemm(x, w, qtype, dense_rows=0), bg.gemm_scalar(x, w, qtype)):
            assert y.dtype == torch.float32 and y.shape == (M, 13)
            assert ((y.double() - ref).abs() <= 1e-5 * scale + 1e-30).all(), (M, (y.double() - ref).abs().max())


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q8_0, T.IQ4_XS])
def test_long_rows_strided_views_bf16_and_float_out(qtype):
    """Rows longer than a K chunk (4 KiB), weights as a strided view of a wider buffer and every other row of
    it, bf16 x (out in bf16, or float32 with float_out)."""
    block, size = GGML_QUANT_SIZES[qtype]
    K = 50 * 256 if block == 256 else 140 * 32
    wide = random_blocks(qtype, 22, K + 3 * block, seed=7)  # 3 blocks of padding after each row
    view = torch.from_numpy(wide)[::2, : K // block * size]
    assert view.stride(0) != view.shape[1]
    raw = np.ascontiguousarray(wide[::2, : K // block * size])
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(3)).bfloat16()
    ref, scale = reference(x, raw, qtype)
    y = bg.gemm(x, view, qtype)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 11)
    assert ((y.double() - ref).abs() <= 1e-5 * scale + 2**-8 * ref.abs()).all()
    yf = bg.gemm(x, view, qtype, float_out=True)
    assert yf.dtype == torch.float32 and ((yf.double() - ref).abs() <= 1e-5 * scale).all()
    one = bg.gemm(x[1:2], view, qtype, True)  # a row alone: whole-row dots, not K chunks / 4-row dots
    assert ((one.double() - ref[1:2]).abs() <= 1e-5 * scale[1:2]).all()


def test_x_is_rounded_as_llama_cpp_rounds_it():
    """Q8K: 256 int8 codes of the element with the largest |x| over -127 (its sign in the scale); Q8x: 32 codes
    of max|x| / 127. Either way an element moves by at most half a step, and zero blocks stay zero."""
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    x[2, :256] = 0
    for qtype, n in ((T.Q4_K, 256), (T.Q8_0, 32)):
        xq = bg.quantize_act(x, qtype)
        step = x.view(3, -1, n).abs().amax(-1, keepdim=True) / 127
        codes = xq.view(3, -1, n) / step.clamp_min(1e-30)
        assert (codes.abs() <= 127 + 1e-3).all() and (codes - codes.round()).abs().max() < 1e-3
        assert ((xq - x).view(3, -1, n).abs() <= step / 2 * (1 + 1e-5)).all()
        assert torch.equal(xq[2, :256], torch.zeros(256))


@pytest.mark.parametrize("qtype", [T.Q2_K, T.Q4_K, T.Q8_0, T.IQ3_XXS])
def test_many_rows_run_as_a_bf16_gemm_over_the_dequantized_weight(qtype):
    """dense_rows = 3: 5 rows of bf16 x against a strided view go through the bf16 GEMM (the exact dequantized
    weight rounded to bf16, float32 sums, bf16 out); 2 rows, float32 x and float32 logits stay on the integer
    dots."""
    block, size = GGML_QUANT_SIZES[qtype]
    K = 3 * 256
    wide = random_blocks(qtype, 14, K + block, seed=11)
    view = torch.from_numpy(wide)[::2, : K // block * size]
    w = torch.from_numpy(
        gguf_dequantize(np.ascontiguousarray(wide[::2, : K // block * size]), qtype).astype(np.float32)
    )
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(4))
    xb, wb = x.bfloat16().double(), w.bfloat16().double()
    ref, scale = xb @ wb.t(), xb.abs() @ wb.abs().t()
    yb = bg.gemm(x.bfloat16(), view, qtype, dense_rows=3)
    assert yb.dtype == torch.bfloat16 and ((yb.double() - ref).abs() <= 1e-5 * scale + 2**-8 * ref.abs()).all()
    ref_q, scale_q = reference(x.bfloat16(), np.ascontiguousarray(wide[::2, : K // block * size]), qtype)
    assert not ((yb.double() - ref_q).abs() <= 1e-5 * scale_q + 2**-8 * ref_q.abs()).all()  # not the dots' sums
    dots = lambda y, r: ((y.double() - ref_q[:r]).abs() <= 1e-5 * scale_q[:r]).all()  # noqa: E731
    assert dots(bg.gemm(x[:2].bfloat16(), view, qtype, float_out=True, dense_rows=3), 2)  # below the threshold
    assert dots(bg.gemm(x.bfloat16(), view, qtype, float_out=True, dense_rows=3), 5)  # logits
    assert dots(bg.gemm(x.bfloat16().float(), view, qtype, float_out=True, dense_rows=3), 5)  # float32 x


def dequant_experts(w: torch.Tensor, qtype: T) -> torch.Tensor:
    """[E, rows, row_bytes] raw blocks -> float64 [E, rows, K] by gguf-py."""
    flat = np.ascontiguousarray(w.reshape(-1, w.shape[-1]).numpy())
    return torch.from_numpy(gguf_dequantize(flat, qtype).astype(np.float32)).double().view(*w.shape[:2], -1)


def moe_reference(x, ids, wts, weights, qtypes):
    """The op's sums in float64 from gguf-py's dequantized weights (gate, up, down), x and h rounded as the
    kernel rounds them."""
    (gate, up, down), (tg, tu, td) = weights, qtypes
    out = torch.zeros(x.shape, dtype=torch.float64)
    xg, xu = bg.quantize_act(x.float(), tg).double(), bg.quantize_act(x.float(), tu).double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = (F.silu(xg[t] @ gate[e].t()) * (xu[t] @ up[e].t())).float()[None]
            out[t] += float(wts[t, j]) * (bg.quantize_act(h, td).double() @ down[e].t())[0]
    return out


@pytest.mark.parametrize("qtypes", [(T.Q2_K, T.Q3_K, T.IQ4_XS), (T.IQ4_NL, T.Q8_0, T.Q6_K), (T.Q4_K, T.IQ4_NL, T.Q5_K)])
def test_moe_is_the_weighted_sum_of_the_chosen_experts(qtypes):
    """6 experts (one never chosen), top-3, H = 256, I = 512; 1 token (decode) and 9 (slots grouped by expert,
    some experts with several); the experts as strided views of a wider buffer; bf16 x and int32 ids too."""
    E, H, I, k = 6, 256, 512, 3
    tg, tu, td = qtypes
    gate = torch.from_numpy(random_blocks(tg, E * I, H, 1)).view(E, I, -1)
    up = torch.from_numpy(random_blocks(tu, E * I, H, 2)).view(E, I, -1)
    wide = torch.from_numpy(random_blocks(td, E * H, I + 256, 3)).view(E, H, -1)
    down = wide[:, :, : I // GGML_QUANT_SIZES[td][0] * GGML_QUANT_SIZES[td][1]]  # row stride > row bytes
    weights = dequant_experts(gate, tg), dequant_experts(up, tu), dequant_experts(down, td)
    g = torch.Generator().manual_seed(5)
    for T_ in (1, 7):
        x = torch.randn(T_, H, generator=g)
        ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T_)])
        wts = torch.rand(T_, k, generator=g)
        ref = moe_reference(x, ids, wts, weights, qtypes)
        tol = 2e-3 * ref.abs().max()  # h's rounding may land a code on the other side of a tie
        y = bg.moe(x, ids, wts, gate, up, down, qtypes)
        assert y.dtype == torch.float32 and (y.double() - ref).abs().max() <= tol
        yb = bg.moe(x.bfloat16(), ids.int(), wts.bfloat16(), gate, up, down, qtypes)
        ref_b = moe_reference(x.bfloat16(), ids, wts.bfloat16().float(), weights, qtypes)
        assert yb.dtype == torch.bfloat16 and (yb.double() - ref_b).abs().max() <= tol + 2**-8 * ref_b.abs().max()


def dense_moe_reference(x, ids, wts, weights):
    """The dense experts' sums in float64: x and the weights in bf16, each GEMM's output, SiLU and the product
    rounded to bf16 as the op's bf16 GEMMs round them."""
    gate, up, down = (w.to(torch.bfloat16).double() for w in weights)
    xb, out = x.to(torch.bfloat16).double(), torch.zeros(x.shape, dtype=torch.float64)
    bf = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = bf(bf(F.silu(bf(xb[t] @ gate[e].t()))) * bf(xb[t] @ up[e].t()))
            out[t] += float(wts[t, j]) * bf(h @ down[e].t())
    return out


@pytest.mark.parametrize("qtypes", [(T.Q4_K, T.Q4_K, T.Q5_0), (T.IQ2_XXS, T.IQ3_S, T.IQ4_NL)])
def test_moe_runs_experts_with_many_slots_as_bf16_gemms(qtypes):
    """dense_rows = 3: experts chosen by >= 3 of the 8 tokens go through dequantized bf16 GEMMs, the others
    through the integer dots, in one call; each part against its own reference, and the same call with
    dense_rows = 0 within the two paths' roundings."""
    E, H, I, k = 5, 256, 256, 2
    tg, tu, td = qtypes
    gate = torch.from_numpy(random_blocks(tg, E * I, H, 4)).view(E, I, -1)
    up = torch.from_numpy(random_blocks(tu, E * I, H, 5)).view(E, I, -1)
    down = torch.from_numpy(random_blocks(td, E * H, I, 6)).view(E, H, -1)
    weights = dequant_experts(gate, tg), dequant_experts(up, tu), dequant_experts(down, td)
    g = torch.Generator().manual_seed(7)
    x, wts = torch.randn(8, H, generator=g).bfloat16().float(), torch.rand(8, k, generator=g)
    ids = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 1], [0, 4], [2, 0], [1, 3], [0, 4]])  # 0: 6 slots, 1: 4, rest 2
    dense = ids.clone().apply_(lambda e: e in (0, 1)).bool()
    ref = dense_moe_reference(x, ids, wts * dense, weights) + moe_reference(x, ids, wts * ~dense, weights, qtypes)
    y = bg.moe(x.bfloat16(), ids, wts, gate, up, down, qtypes, dense_rows=3).double()
    scale = ref.abs().max()
    assert (y - ref).abs().max() <= 2**-7 * scale  # bf16 out and a rounding tie apart; the dots path is ~1e-2 off
    dots = bg.moe(x, ids, wts, gate, up, down, qtypes, dense_rows=3).double()  # float32 x: the dots throughout
    assert (dots - moe_reference(x, ids, wts, weights, qtypes)).abs().max() <= 2e-3 * scale
    assert (y - dots).abs().max() <= 0.03 * scale


def test_refusals_and_iq_tables():
    w = torch.from_numpy(random_blocks(T.Q4_K, 4, 256, 0))
    with pytest.raises(RuntimeError, match="no block kernel"):
        bg.gemm(torch.randn(2, 256), w, T.F16)
    with pytest.raises(RuntimeError, match="columns"):
        bg.gemm(torch.randn(2, 512), w, T.Q4_K)
    with pytest.raises(RuntimeError, match="whole blocks"):
        bg.gemm(torch.randn(2, 256), w[:, :100], T.Q4_K)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        bg.gemm(torch.randn(2, 256).half(), w, T.Q4_K)
    gate = torch.from_numpy(random_blocks(T.Q4_K, 512, 256, 1)).view(2, 256, -1)
    with pytest.raises(RuntimeError, match="outside"):
        bg.moe(torch.randn(1, 256), torch.tensor([[2]]), torch.ones(1, 1), gate, gate, gate, (T.Q4_K,) * 3)
    assert bg.gemm(torch.randn(0, 256), w, T.Q4_K).shape == (0, 4)
    assert not torch.ops.ember_cpu.block_set_iq_table("no such table", torch.zeros(4, dtype=torch.uint8))
    assert not torch.ops.ember_cpu.block_set_iq_table("ksigns", torch.zeros(4, dtype=torch.uint8))


def test_fakes_give_the_ops_shapes():
    """What torch.compile traces the ops with (the fakes registered with the library), on meta tensors."""
    w = torch.empty(5, 220, dtype=torch.uint8, device="meta")  # 5 rows of 512 Q3_K weights
    experts = torch.empty(5, 256, 110, dtype=torch.uint8, device="meta")
    x = torch.empty(3, 512, dtype=torch.bfloat16, device="meta")
    assert bg.gemm(x, w, T.Q3_K).shape == (3, 5) and bg.gemm(x, w, T.Q3_K, True).dtype == torch.float32
    assert bg.dequant_rows(w[:2], T.Q3_K).shape == (2, 512)
    ids, wts = torch.zeros(3, 2, dtype=torch.long, device="meta"), torch.ones(3, 2, device="meta")
    y = bg.moe(x[:, :256], ids, wts, experts, experts, experts, (T.Q3_K,) * 3)
    assert y.shape == (3, 256) and y.dtype == torch.bfloat16


def test_avx2_build_passes_this_module():
    """Where this machine targets AVX-512, the kernel is compiled -march=haswell (what an AVX2-only CPU builds:
    no VNNI) under the name this machine looks for, and this module's other tests run against it."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build("cpu_block_gemv.cpp")
    run = avx2_child.run_module(env, __file__)
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-3000:]
