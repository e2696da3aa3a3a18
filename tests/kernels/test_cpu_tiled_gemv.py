"""The tiled CPU GEMV (ember/kernels/cpu_tiled_gemv.*): exact repacking, the kernel against a
float64 reference over every row-chunk shape, the GGUF TiledPart around it, the K-quants' two levels of
scales, its Q6_K tiles (TiledQ6KPart), and tracing it under torch.compile; in this machine's build, and
(test_avx2_build_passes_this_module) in the AVX2 one."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from ember.kernels import cpu_tiled_gemv as tg
from ember.kernels.cpp_build import has_cpu_flags
from ember.kernels.cpu_kernels import CpuKernels
from ember.quant.gemm_dispatch import INT4_KERNEL_MAX_ROWS as KERNEL_MAX_ROWS
from ember.quant.gemm_dispatch import TILED_Q8_MIN_ROWS
from ember.quant.gguf_blocks import affine_codes, q6_k_blocks
from ember.quant.gguf_quant import GGUFLinearMethod, Int4Part, TiledPart, TiledQ6KPart, pack_shards
from tests.kernels import avx2_child
from tests.quant.test_gguf_packed import gguf_tensor

# This project's machines (and CI's) have been Zen4 (AVX-512 BF16: the bf16 build) and Zen3 (AVX2:
# the float32 build); a CPU with neither falls back to Int4Part, which test_gguf_packed covers.
pytestmark = pytest.mark.skipif(tg.x_dtype() is None, reason="the tiled GEMV needs AVX-512 BF16 or AVX2+FMA+F16C")
X = tg.x_dtype()  # the activation dtype of this machine's build
OTHER = torch.float32 if X == torch.bfloat16 else torch.bfloat16


def affine(N, K, bits, seed, fp16_scales=True):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (N, K), generator=g)
    scale = torch.rand(N, K // 32, generator=g) * 0.02 + 0.001
    offset = (torch.rand(N, K // 32, generator=g) - 0.5) * 0.2
    if fp16_scales:
        scale, offset = scale.half().float(), offset.half().float()
    w = (codes.float().view(N, K // 32, 32) * scale[..., None] + offset[..., None]).view(N, K)
    return codes, scale, offset, w


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_keeps_codes_and_scales_exactly(bits):
    codes, scale, offset, w = affine(40, 96, bits, 0)  # 40 rows: padded to 48
    tiles, s, o = tg.pack(codes, scale, offset, bits)
    assert tiles.shape == (3, 3, tg.TILE_BYTES[bits]) and s.shape == o.shape == (3, 3, 16)
    assert s.dtype == torch.float16  # fp16-exact scales stay 2 bytes
    ids = torch.tensor([39, 0, 17, 16, 15])
    assert torch.equal(tg.unpack_rows(tiles, s, o, bits, ids), w[ids])
    assert torch.equal(tg.dequantize(tiles, s, o, bits, torch.float32, 40), w)
    assert not tg.dequantize(tiles, s, o, bits, torch.float32)[40:].any()  # padding rows are zero
    # scales that float16 would round are kept in float32
    codes, scale, offset, w = affine(16, 64, bits, 1, fp16_scales=False)
    tiles, s, o = tg.pack(codes, scale, offset, bits)
    assert s.dtype == torch.float32 and torch.equal(tg.dequantize(tiles, s, o, bits, torch.float32), w)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fp16_scales", [True, False])
def test_gemv_matches_float64_reference(bits, fp16_scales):
    """Every x-row chunking (1-4 rows a pass, remainders), both output dtypes. bf16 build: the
    products of exact codes and bf16 x are summed in float32, so the error is float32 summation
    noise. float32 build: each group of 32 inputs of x is rounded to int16 steps of the group's
    largest |x|, so the kernel computes W x' with |x' - x| <= half a step per input, exactly up to
    float32 rounding: the error stays within sum_k |W[n, k]| * half_step(k) plus that noise."""
    assert tg.available()
    codes, scale, offset, w = affine(200, 576, bits, 2, fp16_scales)
    packed = tg.pack(codes, scale, offset, bits)
    g = torch.Generator().manual_seed(3)
    for M in (1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 35):  # from 16 rows the AVX2 build's many-row path
        x = torch.randn(M, 576, generator=g).to(X)
        ref = x.double() @ w.double().t()
        y = tg.gemv(x, *packed, bits, float_out=True)
        assert y.shape == (M, 208) and y.dtype == torch.float32
        assert not y[:, 200:].any()  # padding rows
        tol = 1e-5 * (x.double().abs() @ w.double().abs().t())  # relative to the sum of |terms|
        tol = tol + tg.rounding_bound(x, w)  # zero in the bf16 build
        assert ((y[:, :200].double() - ref).abs() <= tol).all(), M
        yb = tg.gemv(x, *packed, bits)
        assert yb.dtype == X and torch.equal(yb, y.to(X))


@pytest.mark.parametrize("bits", [4, 8])
def test_many_row_path_gives_the_gemv_bits(bits):
    """The AVX2 build's many-row path (codes widened once per tile, 3 rows of x a pass) sums the
    same int32 products and runs the same float32 epilogue as the few-row GEMV: the same bits, row
    by row, for every remainder of its row blocks and work chunks (256 rows)."""
    codes, scale, offset, _ = affine(72, 160, bits, 9)
    packed = tg.pack(codes, scale, offset, bits)
    x = torch.randn(260, 160, generator=torch.Generator().manual_seed(10)).to(X)
    one_by_one = torch.cat([tg.gemv(x[i : i + 1].contiguous(), *packed, bits, float_out=True) for i in range(260)])
    for M in (16, 17, 18, 260):
        assert torch.equal(tg.gemv(x[:M].contiguous(), *packed, bits, float_out=True), one_by_one[:M]), M


def test_gemv_zero_and_non_finite_x():
    """A group of x that is all zero contributes nothing (no division by its zero step); a NaN or
    an inf in x reaches every output as NaN / inf, as in a float GEMV, never a silent finite value."""
    codes, scale, offset, w = affine(32, 96, 4, 8)
    packed = tg.pack(codes, scale, offset, 4)
    x = torch.randn(3, 96)
    x[0, :32] = 0  # one zero group
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    y = tg.gemv(x.to(X), *packed, 4, float_out=True)
    ref = x[0].to(X).double() @ w.double().t()  # the x the kernel sees (bf16-rounded in that build)
    tol = 1e-5 * (x[0].to(X).double().abs() @ w.double().abs().t()) + tg.rounding_bound(x[:1].to(X), w)[0]
    assert ((y[0].double() - ref).abs() <= tol).all()
    assert y[1].isnan().all() and not y[2].isfinite().any()
    many = tg.gemv(x.repeat(6, 1).to(X), *packed, 4, float_out=True)  # 18 rows: the many-row path too
    torch.testing.assert_close(many, y.repeat(6, 1), rtol=0, atol=0, equal_nan=True)


needs_q8 = pytest.mark.skipif(not tg.has_q8(), reason="the int8-x path needs AVX-512 BF16, VNNI and VBMI")


@needs_q8
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fp16_scales", [True, False])
def test_gemm_q8_matches_its_int8_reference(bits, fp16_scales):
    """gemm_q8 multiplies exact codes by x rounded to int8 steps per group of 32 (q8_reference), sums
    in int32 per group and in float32 across groups: float32 summation noise away from q8_reference(x)
    @ W^T, for every row block (8 a pass) and remainder, both output dtypes. And the rounding is real:
    the result is nearer q8_reference's product than x's own (so a path that skipped it would fail)."""
    codes, scale, offset, w = affine(200, 576, bits, 11, fp16_scales)
    packed = tg.pack(codes, scale, offset, bits)
    g = torch.Generator().manual_seed(12)
    for M in (1, 5, 7, 8, 9, 16, 17, 300):  # 300: a second 256-row work chunk
        x = torch.randn(M, 576, generator=g).to(torch.bfloat16)
        xq = tg.q8_reference(x)
        half_step = x.double().view(M, 18, 32).abs().amax(2, keepdim=True) / 254
        assert ((xq - x.double()).view(M, 18, 32).abs() <= half_step * (1 + 1e-6)).all()
        ref = xq @ w.double().t()
        y = tg.gemm_q8(x, *packed, bits, float_out=True)
        assert y.shape == (M, 208) and y.dtype == torch.float32 and not y[:, 200:].any()
        tol = 1e-5 * (xq.abs() @ w.double().abs().t())
        assert ((y[:, :200].double() - ref).abs() <= tol).all(), M
        exact = x.double() @ w.double().t()
        assert (y[:, :200].double() - ref).abs().sum() < (y[:, :200].double() - exact).abs().sum()
        yb = tg.gemm_q8(x, *packed, bits)
        assert yb.dtype == torch.bfloat16 and torch.equal(yb, y.to(torch.bfloat16))


@needs_q8
def test_gemm_q8_zero_and_non_finite_x():
    """An all-zero group contributes nothing (step 0); a NaN or inf reaches every output of its row
    as NaN / inf, never a silent finite value; other rows are untouched."""
    codes, scale, offset, w = affine(32, 96, 4, 13)
    packed = tg.pack(codes, scale, offset, 4)
    x = torch.randn(6, 96).to(torch.bfloat16)
    x[0, :32] = 0
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    y = tg.gemm_q8(x, *packed, 4, float_out=True)
    ok = [0, 3, 4, 5]
    torch.testing.assert_close(y[ok].double(), tg.q8_reference(x[ok]) @ w.double().t(), rtol=1e-5, atol=1e-5)
    assert y[1].isnan().all() and not y[2].isfinite().any()


@needs_q8
def test_gemm_q8_off_keeps_bf16_x():
    """--no-cpu-int8-activations: parts packed while it is off never take the int8-x path."""
    t, ref = gguf_tensor(T.Q4_1, 64, 256, seed=14)
    (part,) = pack_shards([t], X, "cpu", kernels=CpuKernels(int8_activations=False))
    x = torch.randn(16, 256).to(X)
    assert not part.kernel_at_any_rows and part.precise_logits(x)
    torch.testing.assert_close(part.linear_float(x), x.float() @ ref.t(), rtol=1e-4, atol=1e-4)


def test_gemv_refuses_bad_inputs_with_a_message():
    packed = tg.pack(*affine(16, 64, 4, 4)[:3], 4)
    with pytest.raises(RuntimeError, match="this build's dtype"):
        tg.gemv(torch.randn(1, 64).to(OTHER), *packed, 4)
    with pytest.raises(RuntimeError, match="this build's dtype"):
        tg.gemv(torch.randn(1, 128).to(X)[:, ::2], *packed, 4)  # not contiguous
    with pytest.raises(RuntimeError, match="codes"):
        tg.gemv(torch.randn(1, 96).to(X), *packed, 4)
    with pytest.raises(RuntimeError, match="bits"):
        tg.gemv(torch.randn(1, 64).to(X), *packed, 5)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K, T.Q8_0, T.Q5_1])
def test_gguf_parts_are_tiled_and_match_the_file(qtype):
    t, ref = gguf_tensor(qtype, 96, 512, seed=5)
    (part,) = pack_shards([t], X, "cpu")
    assert isinstance(part, TiledPart) and part.bits == (4 if qtype in (T.Q4_0, T.Q4_1, T.Q4_K) else 8)
    assert torch.equal(part.dequantize(), ref) and torch.equal(part.rows(torch.tensor([95, 3])), ref[[95, 3]])
    g = torch.Generator().manual_seed(6)
    # many-row paths: the AVX2 build's widened tiles, the bf16 build's int8-x path (VNNI)
    assert part.kernel_at_any_rows == (X == torch.float32 or tg.has_q8())
    for rows in (1, 4, 6, KERNEL_MAX_ROWS + 1):  # GEMV, GEMV, int8 x (or GEMV), int8 x (or a dense GEMM over W)
        x = torch.randn(rows, 512, generator=g).to(X)
        exact = x.float() @ ref.t()
        got = part.linear(x)
        assert got.dtype == X and got.shape == (rows, 96)
        assert (got.float() - exact).abs().max() <= 0.01 * exact.abs().max()
        q8 = tg.has_q8() and rows >= TILED_Q8_MIN_ROWS
        if q8:  # the x it multiplies is x rounded to int8 per group of 32, exactly as q8_reference
            torch.testing.assert_close(
                part.linear_float(x).double(), tg.q8_reference(x) @ ref.double().t(), rtol=1e-4, atol=1e-4
            )
            assert not part.precise_logits(x)  # so an LM head on it refines its top candidates
        elif (
            part.kernel_at_any_rows or rows <= KERNEL_MAX_ROWS
        ):  # float32 out: float32 summation noise (+ int16-rounded x in float32 builds)
            tol = 1e-4 if X == torch.bfloat16 else 1e-3
            torch.testing.assert_close(part.linear_float(x), exact, rtol=tol, atol=tol)
    # bf16: the tiled part is at least as close to the file's weights as torch's int4 kernel path
    # (which rounds its scales to bf16); float32, where that path is exact, within 1e-4 of the range
    c, s, o = affine_codes(t.raw(), qtype)
    old = Int4Part(c, s, o, X, split8=part.bits == 8)
    x = torch.randn(4, 512, generator=g).to(X)
    exact = x.float() @ ref.t()
    bound = (old.linear(x).float() - exact).abs().max() if X == torch.bfloat16 else 1e-4 * exact.abs().max()
    assert (part.linear_float(x) - exact).abs().max() <= bound


def test_knob_off_and_the_other_dtype_keep_torchs_int4_kernel():
    t, _ = gguf_tensor(T.Q4_1, 64, 256, seed=7)
    assert isinstance(pack_shards([t], OTHER, "cpu")[0], Int4Part)  # not this build's dtype
    assert isinstance(pack_shards([t], X, "cpu", kernels=CpuKernels(tiled_gemv=False))[0], Int4Part)


@pytest.mark.parametrize("cpp_wrapper", [False, True])
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q6_K])
def test_traced_by_torch_compile(cpp_wrapper, qtype):
    """The ops have fake kernels, so a compiled decode graph calls them with no graph break, from
    inductor's Python wrapper or its C++ one (the compiled executor's default)."""
    from ember.layers.linear import RowParallelLinear

    if qtype == T.Q6_K and not tg.has_q6k():
        pytest.skip("the Q6_K tiles need the bf16 build")
    t, ref = gguf_tensor(qtype, 64, 256, seed=8)
    layer = RowParallelLinear(256, 64, dtype=X, quant_method=GGUFLinearMethod())
    layer.load_weight("weight", t, None)
    layer.quant_method.process_weights_after_loading(layer)
    assert isinstance(layer.gguf_parts[0], TiledQ6KPart if qtype == T.Q6_K else TiledPart)
    x = torch.randn(2, 256).to(X)
    compiled = torch.compile(layer, fullgraph=True, options={"cpp_wrapper": cpp_wrapper})
    assert torch.equal(compiled(x), layer(x))
    exact = F.linear(x.float(), ref)
    assert (layer(x).float() - exact).abs().max() <= 0.01 * exact.abs().max()


# ---- K-quant scales (both builds) ------------------------------------------------------------------

needs_k_scales = pytest.mark.skipif(not tg.has_k_scales(), reason="K-quant scales need the tiled GEMV")


def k_quant(N, K, bits, seed):
    """Random Q4_K / Q5_K-like fields (codes, 6-bit sc and m, float16 d and dmin) and their flat float32
    scale and offset (d sc, -dmin m: exact)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (N, K), generator=g, dtype=torch.uint8)
    sc, m = (torch.randint(0, 64, (N, K // 32), generator=g, dtype=torch.uint8) for _ in range(2))
    d, dmin = ((torch.rand(N, K // 256, generator=g) * 1e-3).half() for _ in range(2))
    scale = d.float().repeat_interleave(8, dim=1) * sc.float()
    offset = -(dmin.float().repeat_interleave(8, dim=1) * m.float())
    return codes, sc, m, d, dmin, scale, offset


@needs_k_scales
@pytest.mark.parametrize("bits", [4, 8])
def test_k_scales_give_the_flat_float32_results(bits):
    """Q4_K / Q5_K's two levels kept (6-bit sc, m per 32; float16 d, dmin per 256: 0.078 B a weight of
    scales against flat float32's 0.25): d sc and -dmin m are exact in float32, so rows, the GEMV (and the
    AVX2 build's many-row path, from 16 rows) and the int8-x path give the very bits of the flat float32
    store, for every row chunking."""
    assert tg.available()
    N, K = 40, 768
    codes, sc, m, d, dmin, scale, offset = k_quant(N, K, bits, 30)
    kq = tg.pack_k(codes, sc, m, d, dmin, bits)
    flat = tg.pack(codes, scale, offset, bits)
    assert flat[1].dtype == torch.float32  # d sc is no float16
    assert kq[1].dtype == torch.uint8 and kq[1].shape == (3, 24, 2, 16) and kq[2].shape == (3, 3, 2, 16)
    w = (codes.float().view(N, K // 32, 32) * scale[..., None] + offset[..., None]).view(N, K)
    ids = torch.tensor([39, 0, 17, 16])
    assert torch.equal(tg.unpack_rows(*kq, bits, ids), w[ids])
    assert torch.equal(tg.dequantize(*kq, bits, torch.float32, N), w)
    g = torch.Generator().manual_seed(31)
    for M in (1, 3, 4, 5, 9, 16, 17):
        x = torch.randn(M, K, generator=g).to(X)
        assert torch.equal(tg.gemv(x, *kq, bits, float_out=True), tg.gemv(x, *flat, bits, float_out=True)), M
        if tg.has_q8():
            assert torch.equal(tg.gemm_q8(x, *kq, bits, float_out=True), tg.gemm_q8(x, *flat, bits, float_out=True))


@needs_k_scales
@pytest.mark.parametrize("qtype,held", [(T.Q4_K, 0.578125), (T.Q5_K, 1.078125)])
def test_k_quant_parts_keep_their_two_levels(qtype, held):
    t, ref = gguf_tensor(qtype, 48, 512, seed=31)
    (part,) = pack_shards([t], X, "cpu")
    assert isinstance(part, TiledPart) and part.scale.dtype == torch.uint8
    assert sum(b.numel() * b.element_size() for b in part.buffers()) == held * 48 * 512
    assert torch.equal(part.dequantize(), ref) and torch.equal(part.rows(torch.tensor([47, 5])), ref[[47, 5]])
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(32)).to(X)
    tol = 1e-5 * (x.double().abs() @ ref.double().abs().t()) + tg.rounding_bound(x, ref)
    assert ((part.linear_float(x).double() - x.double() @ ref.double().t()).abs() <= tol).all()


# ---- Q6_K tiles (both builds) ----------------------------------------------------------------------

needs_q6k = pytest.mark.skipif(not tg.has_q6k(), reason="the Q6_K tiles need the tiled GEMV")


def q6k(N, K, seed):
    """Random Q6_K fields (q6 0..63, int8 S of both signs, extremes included, float16 d) and W."""
    g = torch.Generator().manual_seed(seed)
    q6 = torch.randint(0, 64, (N, K), generator=g, dtype=torch.uint8)
    sub = torch.randint(-128, 128, (N, K // 16), generator=g, dtype=torch.int8)
    sub[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    q6[1, :16], q6[1, 16:32] = 0, 63  # the codes' extremes in both halves of a tile
    d = (torch.rand(N, K // 256, generator=g) * 1e-3 + 1e-5).half()
    c = d.float().repeat_interleave(16, dim=1) * sub.float()  # exact: 11 x 8 significant bits
    w = (c.view(N, K // 16, 1) * (q6.float().view(N, K // 16, 16) - 32)).view(N, K)
    return q6, sub, d, w


@needs_q6k
@pytest.mark.parametrize("N,K", [(40, 256), (37, 1024), (16, 3584)])
def test_q6k_pack_keeps_the_files_bits(N, K):
    """The tiles hold the codes, S and d as they are (0.82 B a weight, the file's 210 / 256): rows and
    the whole matrix come back bit for bit; padding rows are zero."""
    q6, sub, d, w = q6k(N, K, 20)
    tiles, s, dd = tg.pack_q6k(q6, sub, d)
    T = -(-N // 16)
    assert tiles.shape == (T, K // 32, 384) and s.shape == (T, K // 32, 2, 16) and dd.shape == (T, K // 256, 16)
    assert sum(t.numel() * t.element_size() for t in (tiles, s, dd)) == T * 16 * K * 210 / 256
    ids = torch.tensor([N - 1, 0, N // 2, 15, min(16, N - 1)])
    assert torch.equal(tg.unpack_rows_q6k(tiles, s, dd, ids), w[ids])
    assert torch.equal(tg.dequantize_q6k(tiles, s, dd, torch.float32, N), w)
    assert not tg.dequantize_q6k(tiles, s, dd, torch.float32)[N:].any()


@needs_q6k
@pytest.mark.parametrize("N,K", [(40, 256), (37, 1024), (24, 3584)])
def test_q6k_gemv_matches_float64_reference(N, K):
    """The GEMV over Q6_K tiles, for every x-row chunking (1-4 rows a pass; from 16 rows the AVX2 build's
    many-row path) and both output dtypes. bf16 build: exact codes times bf16 x, summed in float32 per
    sub-block of 16 from -160 sum(x) (the codes enter as 128 + q6), scaled by d S: float32 noise away from
    x @ W^T. AVX2 build: x rounded to int16 steps per group of 32, exact int32 sums per sub-block of
    (q6 - 32) q: within rounding_bound of x @ W^T, plus that noise."""
    assert tg.available()
    q6, sub, d, w = q6k(N, K, 21)
    packed = tg.pack_q6k(q6, sub, d)
    g = torch.Generator().manual_seed(22)
    for M in (1, 2, 3, 4, 5, 7, 9, 16, 17, 35):
        x = torch.randn(M, K, generator=g).to(X)
        y = tg.gemv_q6k(x, *packed, float_out=True)
        assert y.shape == (M, -(-N // 16) * 16) and y.dtype == torch.float32 and not y[:, N:].any()
        tol = 1e-5 * (x.double().abs() @ w.double().abs().t()) + tg.rounding_bound(x, w)
        assert ((y[:, :N].double() - x.double() @ w.double().t()).abs() <= tol).all(), M
        yb = tg.gemv_q6k(x, *packed)
        assert yb.dtype == X and torch.equal(yb, y.to(X))


@needs_q6k
def test_q6k_many_row_path_gives_the_gemv_bits():
    """The AVX2 build's many-row path over Q6_K tiles (codes widened once per tile as q6 - 32, 3 rows of x
    a pass) sums the same integers per sub-block as its GEMV (which starts each at -32 sum(q)) and runs
    the same float32 epilogue: the same bits, row by row, for every remainder of its row blocks and work
    chunks (256 rows). In the bf16 build every row count is the GEMV, so this holds trivially there."""
    q6, sub, d, _ = q6k(72, 512, 27)
    packed = tg.pack_q6k(q6, sub, d)
    x = torch.randn(260, 512, generator=torch.Generator().manual_seed(28)).to(X)
    one_by_one = torch.cat([tg.gemv_q6k(x[i : i + 1].contiguous(), *packed, float_out=True) for i in range(260)])
    for M in (16, 17, 18, 260):
        assert torch.equal(tg.gemv_q6k(x[:M].contiguous(), *packed, float_out=True), one_by_one[:M]), M


@needs_q6k
@needs_q8
@pytest.mark.parametrize("N,K", [(40, 256), (37, 1024), (24, 3584)])
def test_q6k_gemm_q8_matches_its_int8_reference(N, K):
    """The int8-x path over Q6_K tiles: x rounded to int8 per group of 32 (q8_reference), exact int32
    sums per sub-block of 16, float32 across: float32 noise away from q8_reference(x) @ W^T for every
    row block (8 a pass), remainder and 256-row work chunk; and nearer it than x's own product."""
    q6, sub, d, w = q6k(N, K, 23)
    packed = tg.pack_q6k(q6, sub, d)
    g = torch.Generator().manual_seed(24)
    for M in (1, 5, 8, 9, 17, 300):
        x = torch.randn(M, K, generator=g).to(torch.bfloat16)
        xq = tg.q8_reference(x)
        y = tg.gemm_q8_q6k(x, *packed, float_out=True)
        assert y.shape == (M, -(-N // 16) * 16) and not y[:, N:].any()
        ref = xq @ w.double().t()
        tol = 1e-5 * (xq.abs() @ w.double().abs().t())
        assert ((y[:, :N].double() - ref).abs() <= tol).all(), M
        exact = x.double() @ w.double().t()
        assert (y[:, :N].double() - ref).abs().sum() < (y[:, :N].double() - exact).abs().sum()
        assert torch.equal(tg.gemm_q8_q6k(x, *packed), y.to(torch.bfloat16))


@needs_q6k
def test_q6k_zero_and_non_finite_x():
    """As the 4/8-bit tiles: an all-zero group adds nothing, a NaN / inf reaches its row's outputs; at few
    rows and (18 rows) the AVX2 build's many-row path."""
    q6, sub, d, w = q6k(32, 256, 25)
    packed = tg.pack_q6k(q6, sub, d)
    x = torch.randn(6, 256).to(X)
    x[0, :32] = 0
    x[1, 40] = float("nan")
    x[2, 70] = float("inf")
    ok = [0, 3, 4, 5]
    tol = 1e-5 * (x[ok].double().abs() @ w.double().abs().t()) + tg.rounding_bound(x[ok], w)
    y = tg.gemv_q6k(x, *packed, float_out=True)
    assert ((y[ok].double() - x[ok].double() @ w.double().t()).abs() <= tol).all()
    assert y[1].isnan().all() and not y[2].isfinite().any()
    many = tg.gemv_q6k(x.repeat(3, 1), *packed, float_out=True)
    torch.testing.assert_close(many, y.repeat(3, 1), rtol=0, atol=0, equal_nan=True)
    if tg.has_q8():
        y = tg.gemm_q8_q6k(x, *packed, float_out=True)
        torch.testing.assert_close(y[ok].double(), tg.q8_reference(x[ok]) @ w.double().t(), rtol=1e-5, atol=1e-5)
        assert y[1].isnan().all() and not y[2].isfinite().any()


@needs_q6k
def test_q6k_refuses_bad_inputs_with_a_message():
    packed = tg.pack_q6k(*q6k(16, 256, 26)[:3])
    with pytest.raises(RuntimeError, match="this build's dtype"):
        tg.gemv_q6k(torch.randn(1, 256).to(OTHER), *packed)
    with pytest.raises(RuntimeError, match="tiles"):
        tg.gemv_q6k(torch.randn(1, 512).to(X), *packed)
    with pytest.raises(RuntimeError, match="sub_scale"):
        tg.gemv_q6k(torch.randn(1, 256).to(X), packed[0], packed[1].float(), packed[2])
    if not tg.has_q8():
        with pytest.raises(RuntimeError, match="has_q8"):
            tg.gemm_q8_q6k(torch.randn(1, 256).to(X), *packed)
    with pytest.raises(ValueError, match="K % 256"):
        tg.pack_q6k(torch.zeros(16, 96, dtype=torch.uint8), torch.zeros(16, 6, dtype=torch.int8), torch.zeros(16, 1))


@needs_q6k
def test_gguf_q6k_part_is_tiled_and_matches_the_file():
    """A Q6_K GGUF tensor in this build's dtype: TiledQ6KPart, gguf-py's values bit for bit in rows() (the
    embedding lookup and the head's refinement), the GEMV at few rows, from TILED_Q8_MIN_ROWS the int8-x
    path (bf16 build) or the GEMV still (AVX2 build: its many-row path), so no dense copy where either
    serves every row count (kernel_at_any_rows); x in the other dtype: a dense GEMM over W in that dtype."""
    from tests.quant.test_gguf_packed import gguf_tensor as q6k_tensor

    t, ref = q6k_tensor(T.Q6_K, 72, 512, seed=28)
    (part,) = pack_shards([t], X, "cpu")
    assert isinstance(part, TiledQ6KPart) and (part.N, part.K) == (72, 512)
    assert torch.equal(part.dequantize(), ref) and torch.equal(part.rows(torch.tensor([71, 3, 16])), ref[[71, 3, 16]])
    assert part.kernel_at_any_rows == (tg.has_q8() or X == torch.float32)
    g = torch.Generator().manual_seed(29)
    for rows in (1, 4, TILED_Q8_MIN_ROWS, 16, KERNEL_MAX_ROWS + 1):
        x = torch.randn(rows, 512, generator=g).to(X)
        exact = x.double() @ ref.double().t()
        got = part.linear(x)
        assert got.dtype == X and got.shape == (rows, 72)
        if tg.has_q8() and rows >= TILED_Q8_MIN_ROWS:
            want, tol = tg.q8_reference(x) @ ref.double().t(), 1e-5
            assert not part.precise_logits(x)
        else:
            want, tol = exact, 1e-5 if X == torch.bfloat16 else 1e-3  # + int16-rounded x (AVX2)
            assert part.precise_logits(x) == (rows <= KERNEL_MAX_ROWS or X == torch.float32)
        torch.testing.assert_close(part.linear_float(x).double(), want, rtol=tol, atol=tol)
    x = torch.randn(2, 512, generator=g).to(OTHER)  # not the kernel's x: a dense GEMM over W in x's dtype
    assert torch.equal(part.linear(x), F.linear(x, ref.to(OTHER)))
    q6, sub, d = q6_k_blocks(t.raw())
    assert all(torch.equal(a, b) for a, b in zip(part.buffers(), TiledQ6KPart(q6, sub, d).buffers(), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("march", [["-march=haswell"], ["-march=haswell", "-mavxvnni"]], ids=["haswell", "avxvnni"])
def test_avx2_build_passes_this_module(march):
    """Where this machine's build is the bf16 one (AVX-512 BF16), the AVX2 + FMA + F16C build (Zen2/3,
    Haswell on: float32 x in int16 steps; 4- and 8-bit tiles, the K-quants' two levels, Q6_K's tiles) is
    compiled here with -march=haswell (and again with AVX-VNNI, Intel's 12th gen on, whose vpdpwssd sums
    the same products in one instruction) under the name this machine looks for, in a kernel dir of its
    own, and this module's other tests run against it in a child process that reads the CPU flags as
    such a machine's (tests/kernels/haswell_flags.py)."""
    if X != torch.bfloat16:
        pytest.skip("this machine's own build is the AVX2 one")
    if "-mavxvnni" in march and not has_cpu_flags("avx_vnni"):
        pytest.skip("this CPU has no AVX-VNNI")
    env = avx2_child.build("cpu_tiled_gemv.cpp", tuple(march))
    probe = "from ember.kernels import cpu_tiled_gemv as g; "
    probe += "print(g.x_dtype(), g.available(), g.has_q6k(), g.has_k_scales(), g.has_q8())"
    said, run = avx2_child.probe_and_run(env, probe, __file__)
    assert said == ["torch.float32", "True", "True", "True", "False"]
    assert run.returncode == 0 and " passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
