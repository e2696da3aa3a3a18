"""GGUF weights kept packed: block unpacking against gguf-py, the exact int4 repack, mixed-type
fused layers, the packed embedding / tied head, tiny GGUF models and the default model against
their dequantized twins."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from ember.kernels import cpu_tiled_gemv as tiled_gemv
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.linear import MergedColumnLinear, QKVLinear
from ember.quant import gguf_quant, process_weights_after_loading
from ember.quant.gemm_dispatch import INT4_KERNEL_MAX_ROWS as KERNEL_MAX_ROWS
from ember.quant.gemm_dispatch import Q6K_KERNEL_MAX_ROWS
from ember.quant.gguf_blocks import GGUFTensor, affine_codes, dequantize, q6_k_blocks, q6_k_codes
from ember.quant.gguf_quant import (
    GGUFConfig,
    GGUFEmbeddingMethod,
    GGUFLinearMethod,
    Int4Part,
    Q6KPart,
    RawPart,
    TiledPart,
    TiledQ6KPart,
    pack_shards,
)
from ember.quant.int4_cpu import unpack_int4_codes
from tests.models.tiny_models import PagedDriver, Seq, one_thread  # noqa: F401 (fixture)

# Under load, two OpenMP threads spin-wait each other into ~100x slower small ops.
pytestmark = pytest.mark.usefixtures("one_thread")

QUANTIZED = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K]


def fp32_affine_part() -> str:
    """The part float32 4/8-bit affine weights get here: the tiled GEMV where its AVX2 build takes
    float32, else torch's int4 kernel."""
    return "TiledPart" if TiledPart.usable(torch.float32, "cpu") else "Int4Part"


def q6k_part(dtype: torch.dtype) -> str:
    """The part Q6_K weights get in `dtype` here: the tiled GEMV's Q6_K tiles in its bf16 build (AVX-512
    BF16), else torch's int4 kernel over a 2K-wide split."""
    return "TiledQ6KPart" if TiledQ6KPart.usable(dtype, "cpu") else "Q6KPart"


def assert_fp32_linear_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None):
    """got = x @ w^T (+ bias) in float32 up to summation noise, plus what the tiled GEMV's AVX2 build
    may add by rounding x to int16 steps (cpu_tiled_gemv.rounding_bound; zero elsewhere)."""
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    tol = 1e-5 + 1e-5 * ref.abs() + tiled_gemv.rounding_bound(x, w)
    assert ((got.double() - ref).abs() <= tol).all(), float((got.double() - ref).abs().max())


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: T, rows: int, cols: int, seed: int = 0, std: float = 0.05) -> np.ndarray:
    """uint8 [rows, bytes_per_row] of valid blocks: gguf-py quantizes the legacy types; K-quants
    (which gguf-py cannot quantize) get random bytes with sane fp16 scale fields."""
    rng = np.random.default_rng(seed)
    if qtype in (T.F16, T.F32):
        return (rng.standard_normal((rows, cols)) * std).astype(np.float16 if qtype == T.F16 else np.float32)
    if qtype not in (T.Q4_K, T.Q5_K, T.Q6_K):
        return gguf_quantize((rng.standard_normal((rows, cols)) * std).astype(np.float32), qtype)
    n = rows * cols // 256
    b = rng.integers(0, 256, (n, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    if qtype in (T.Q4_K, T.Q5_K):  # d, dmin first; |w| <= 63 * d * 15 (31 for Q5_K)
        b[:, 0:2] = _f16_bytes(rng.uniform(0.2, 1, n) * std / (60 if qtype == T.Q4_K else 120))
        b[:, 2:4] = _f16_bytes(rng.uniform(0.2, 1, n) * std / 8)
    else:  # Q6_K: d last; |w| <= 128 * 32 * d
        b[:, 208:210] = _f16_bytes(rng.uniform(0.2, 1, n) * std / 500)
    return b.reshape(rows, -1)


def gguf_tensor(qtype: T, rows: int, cols: int, seed: int = 0):
    """(what the loader yields for it, float32 reference from gguf-py)."""
    data = random_blocks(qtype, rows, cols, seed)
    ref = torch.from_numpy(np.asarray(gguf_dequantize(data, qtype), dtype=np.float32).copy())
    if qtype in (T.F16, T.F32):
        return ref.clone(), ref
    return GGUFTensor(qtype, data, (rows, cols)), ref


# ---- blocks -------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANTIZED)
def test_dequantize_matches_gguf_py_bit_for_bit(qtype):
    t, ref = gguf_tensor(qtype, 6, 512)
    assert torch.equal(dequantize(t.raw(), qtype, 512), ref)
    assert torch.equal(t.dequantize(), ref)


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q4_K])
def test_int4_repack_keeps_codes_and_values(qtype):
    t, ref = gguf_tensor(qtype, 128, 512, seed=1)
    codes, scale, offset = affine_codes(t.raw(), qtype)
    assert codes.max() <= 15
    part = Int4Part(codes, scale, offset, torch.float32)
    assert torch.equal(unpack_int4_codes(part.w.packed, 128, 512), codes)  # the very same integers
    # The kernel computes (q - 8) * s + z with z = offset + 8 s rounded once to float32: within
    # an ulp of the group's z (Q4_0's z is exactly 0, so bit for bit).
    got = part.rows(torch.arange(128))
    z = (offset + 8 * scale).abs().repeat_interleave(32, dim=1)
    tol = torch.finfo(torch.float32).eps * (z + ref.abs())
    assert ((got - ref).abs() <= tol).all()
    if qtype == T.Q4_0:
        assert torch.equal(got, ref)
    torch.testing.assert_close(part.dequantize(), got, rtol=0, atol=float(tol.max()))


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K])
def test_8bit_codes_split_exactly_into_two_nibbles(qtype):
    t, ref = gguf_tensor(qtype, 96, 256, seed=2)  # 96 rows: padded to 128 inside
    codes, scale, offset = affine_codes(t.raw(), qtype)
    part = Int4Part(codes, scale, offset, torch.float32, split8=True)
    assert torch.equal(part.rows(torch.arange(96)), ref)
    assert torch.equal(part.dequantize(), ref)
    x = torch.randn(3, 256)
    torch.testing.assert_close(part.linear(x), F.linear(x, ref), rtol=1e-5, atol=1e-5)


def _q6k_part(rows, cols, seed, dtype):
    t, ref = gguf_tensor(T.Q6_K, rows, cols, seed)
    q, scale = q6_k_codes(t.raw())
    assert q.max() <= 63 and (scale < 0).any() and (scale > 0).any()  # int8 sub-block scales of both signs
    return Q6KPart(q, scale, dtype), ref


def test_q6_k_packed_round_trip():
    part, ref = _q6k_part(96, 512, 3, torch.float32)  # 96 rows: padded to 128 inside
    ids = torch.tensor([95, 0, 64, 31, 32, 63])
    # Codes and scales are kept exactly: float32 rebuilds gguf-py's values bit for bit
    assert torch.equal(part.dequantize(), ref)
    assert torch.equal(part.rows(ids), ref[ids])
    # bf16 runs round the sub-block scales (and only them) to bf16
    part16, _ = _q6k_part(96, 512, 3, torch.bfloat16)
    scale16 = q6_k_codes(gguf_tensor(T.Q6_K, 96, 512, 3)[0].raw())[1].bfloat16().float().repeat_interleave(16, 1)
    q6 = (ref / scale16.where(scale16 != 0, 1) + 32).round()  # the codes back
    assert torch.equal(part16.dequantize(), scale16 * (q6 - 32))
    assert torch.equal(part16.rows(ids), part16.dequantize()[ids])


def test_q6_k_linear_traced_reads_its_spread_from_a_buffer():
    """A traced Q6_K GEMV reads its input spread (1 and 1/16 per sub-block) from a buffer the part holds
    from packing: a lazy cache filled inside the trace left a guard on its contents, which the real
    pool's check then failed (a background-compiled batch-1 graph of a Q4_K_M file stayed eager), and a
    tensor built inside the step is one export cannot find on the model for a package. Same values
    traced and eager."""
    part, _ = _q6k_part(96, 512, 5, torch.bfloat16)
    assert any(b is part.spread for b in part.buffers())
    before = dict(vars(part))
    x = torch.randn(1, 512).bfloat16()
    traced = torch.compile(part.linear, backend=lambda gm, inputs: gm.forward, fullgraph=True)(x)
    assert vars(part).keys() == before.keys() and all(vars(part)[k] is v for k, v in before.items())
    assert torch.equal(traced, part.linear(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q6_k_packed_linear_equals_dequantized_linear(dtype):
    part, ref = _q6k_part(96, 512, 4, dtype)
    c = q6_k_codes(gguf_tensor(T.Q6_K, 96, 512, 4)[0].raw())[1].abs().repeat_interleave(16, 1)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5, Q6K_KERNEL_MAX_ROWS, Q6K_KERNEL_MAX_ROWS + 8, KERNEL_MAX_ROWS + 8):  # kernel, rebuild + GEMM
        x = torch.randn(rows, 512, generator=gen)
        exact = F.linear(x.to(dtype).float(), ref)
        got = part.linear(x.to(dtype))
        assert got.dtype == dtype and got.shape == (rows, 96)
        if dtype == torch.float32:  # exact weights up to the float32 zero point 8 s / 17
            torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
        else:  # about as close as a dense bf16 weight (over 30 seeds: max <= 2.1x, mean <= 1.4x)
            dense = F.linear(x.bfloat16(), ref.bfloat16()).float()
            err, dense_err = (got.float() - exact).abs(), (dense - exact).abs()
            assert err.max() < 3 * dense_err.max() and err.mean() < 1.6 * dense_err.mean(), (err, dense_err)
    # The kernel's effective weights (hi half + lo half / 16), bf16 scales: within 0.2 c of the
    # true value (a dense bf16 weight: 0.125 c); the naive zero point -32 c / 17 would be ~0.8 c.
    if dtype == torch.bfloat16:
        w = part.w.dequantize(torch.float32)[:96].view(96, 32, 2, 16)
        eff = (w[:, :, 0] + w[:, :, 1] / 16).reshape(96, 512)
        assert ((eff - ref).abs() <= 0.2 * c).all()


def test_q6_k_part_resident_bytes():
    part, _ = _q6k_part(128, 1024, 5, torch.bfloat16)
    nbytes = sum(t.numel() * t.element_size() for t in part.buffers())
    # 1 byte of codes + 4 bytes of (s, z) per 16 weights, and the input spread: 2 bf16 a column
    assert nbytes == 1.25 * 128 * 1024 + 2 * 1024 * 2
    assert part.w.packed.shape == (128, 1024)  # [N, 2K] nibbles


# ---- Linear -------------------------------------------------------------------------------------


def _loaded(layer, shards):
    for sid, t in shards.items():
        layer.load_weight("weight", t, sid)
    process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qkv_with_mixed_shard_types_equals_dequantized_linear(dtype):
    # Q4_K_M-like: q and k int4 (one kernel part), v Q6_K (a part of its own), plus a bias
    layer = QKVLinear(256, 64, 4, 2, bias=True, dtype=dtype, quant_method=GGUFLinearMethod())
    tq, rq = gguf_tensor(T.Q4_K, 256, 256, 1)
    tk, rk = gguf_tensor(T.Q4_0, 128, 256, 2)
    tv, rv = gguf_tensor(T.Q6_K, 128, 256, 3)
    _loaded(layer, {"q": tq, "k": tk, "v": tv})
    layer.bias.data.normal_()
    int4 = "TiledPart" if TiledPart.usable(dtype, "cpu") else "Int4Part"  # bf16 on AVX-512 BF16: the tiled GEMV
    assert [type(p).__name__ for p in layer.gguf_parts] == [int4, q6k_part(dtype)]
    assert layer.weight.numel() == 0 and not layer.gguf_pending  # no dense copy, raw views dropped
    w = torch.cat([rq, rk, rv])
    for rows in (1, 5, KERNEL_MAX_ROWS + 8):  # kernel and dequantize-then-GEMM paths
        x = torch.randn(rows, 256).to(dtype)
        ref = F.linear(x.float(), w, layer.bias.float())
        got = layer(x).float()
        if dtype == torch.float32:
            assert_fp32_linear_close(got, x, w, layer.bias)
        else:  # bf16 activations, bf16-rounded block scales, bf16 output
            assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_gate_up_with_q8_0_and_q5_1_shards():
    layer = MergedColumnLinear(256, [192, 192], quant_method=GGUFLinearMethod())
    tg, rg = gguf_tensor(T.Q8_0, 192, 256, 4)
    tu, ru = gguf_tensor(T.Q5_1, 192, 256, 5)
    _loaded(layer, {"up": tu, "gate": tg})  # any load order
    assert [type(p).__name__ for p in layer.gguf_parts] == [fp32_affine_part()]  # both 8-bit: one call
    x = torch.randn(2, 256)
    assert_fp32_linear_close(layer(x), x, torch.cat([rg, ru]))


def test_gate_up_with_q8_0_and_f16_shards():
    layer = MergedColumnLinear(256, [192, 192], quant_method=GGUFLinearMethod())
    tg, rg = gguf_tensor(T.Q8_0, 192, 256, 4)
    tu, ru = gguf_tensor(T.F16, 192, 256, 5)
    _loaded(layer, {"up": tu, "gate": tg})
    assert [type(p).__name__ for p in layer.gguf_parts] == [fp32_affine_part(), "DensePart"]
    x = torch.randn(2, 256)
    assert_fp32_linear_close(layer(x), x, torch.cat([rg, ru]))


def test_q5_k_stays_packed_as_8_bit_codes():
    """Q4_K_M files hold attn_qkv in Q5_K: 5-bit codes, affine per 32, kept packed (once dense bf16)."""
    t, ref = gguf_tensor(T.Q5_K, 192, 512, 11)
    codes, _, _ = affine_codes(t.raw(), T.Q5_K)
    assert codes.max() == 31 and codes.min() == 0
    (part,) = pack_shards([t], torch.bfloat16, "cpu")
    assert type(part).__name__ == ("TiledPart" if TiledPart.usable(torch.bfloat16, "cpu") else "Int4Part")
    got = part.rows(torch.arange(192))
    if isinstance(part, TiledPart):  # codes and float32 scales as they are: gguf-py's values
        assert torch.equal(got, ref)
    else:  # bf16-rounded scales
        assert (got - ref).abs().max() < 0.01 * ref.abs().max()


@pytest.mark.parametrize(
    "qtypes", [(T.Q6_K, T.Q6_K), (T.Q4_K, T.Q4_0), (T.Q8_0, T.Q5_K)], ids=["q6_k", "int4", "int8-scales-widen"]
)
def test_parts_built_in_row_chunks_equal_one_whole_build(monkeypatch, qtypes):
    """Big tensors (a 248K-row embedding) are unpacked PACK_CHUNK_ROWS rows at a time; chunks that span
    shards, a short last chunk, and scales that are float16 in one chunk but float32 in another give
    the very buffers of one build over the whole run."""
    dtype = torch.bfloat16
    if qtypes[0] != T.Q6_K and not TiledPart.usable(dtype, "cpu"):
        pytest.skip("only the tiled GEMV's parts are built in chunks")
    shards = [gguf_tensor(qt, rows, 256, 20 + i)[0] for i, (qt, rows) in enumerate(zip(qtypes, (160, 72)))]
    monkeypatch.setattr(gguf_quant, "PACK_CHUNK_ROWS", 64)
    (chunked,) = pack_shards(shards, dtype, "cpu")
    if qtypes[0] == T.Q6_K and TiledQ6KPart.usable(dtype, "cpu"):
        whole = TiledQ6KPart(*(torch.cat(x) for x in zip(*(q6_k_blocks(t.raw()) for t in shards))))
    elif qtypes[0] == T.Q6_K:
        q, s = (torch.cat(x) for x in zip(*(q6_k_codes(t.raw()) for t in shards)))
        whole = Q6KPart(q, s, dtype)
    else:
        c, s, o = (torch.cat(x) for x in zip(*(affine_codes(t.raw(), t.qtype) for t in shards)))
        whole = TiledPart(c, s, o, bits=4 if qtypes[0] == T.Q4_K else 8)
    assert (chunked.N, chunked.K) == (whole.N, whole.K) == (232, 256)
    for a, b in zip(chunked.buffers(), whole.buffers(), strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if qtypes == (T.Q8_0, T.Q5_K):
        assert whole.scale.dtype == torch.float32  # Q5_K's d * sc is not a float16


def test_copying_raw_blocks_drops_the_maps_pages_from_rss(tmp_path):
    """A packed tensor's bytes are read from the file's map once; the map's pages then leave the
    process's resident set (they were counted beside the packed copy: the whole file in peak RSS)."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("reads RssFile from /proc")

    def rss_file() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile")) * 1024

    rows, cols = 1024, 8192  # Q8_0: 34 bytes per 32 weights, 8.5 MiB a 1024 rows
    path = tmp_path / "blocks.bin"
    path.write_bytes(random_blocks(T.Q8_0, rows, cols, 12).tobytes() * 4)
    mapped = np.memmap(path, mode="r").reshape(4 * rows, -1)
    before = rss_file()
    for i in range(4):
        GGUFTensor(T.Q8_0, mapped[i * rows : (i + 1) * rows], (rows, cols)).raw()
    assert rss_file() - before < mapped.nbytes / 4  # without the release: + the whole map (34 MiB)


def test_raw_part_linear_and_rows():
    t, ref = gguf_tensor(T.Q6_K, 64, 256, 7)
    part = RawPart(t.raw(), T.Q6_K, 256)
    x = torch.randn(3, 256)
    torch.testing.assert_close(part.linear(x), F.linear(x, ref), rtol=1e-5, atol=1e-5)
    assert torch.equal(part.rows(torch.tensor([5, 0, 63])), ref[[5, 0, 63]])


def test_wrong_shard_shape_is_reported():
    from ember.errors import ModelLoadError

    layer = QKVLinear(256, 64, 4, 2, quant_method=GGUFLinearMethod())
    with pytest.raises(ModelLoadError, match="shape"):
        layer.load_weight("weight", gguf_tensor(T.Q4_0, 64, 256)[0], "k")


# ---- embedding and LM head ----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_1, T.Q6_K, T.F16])
def test_embedding_and_tied_head_read_the_packed_data(qtype):
    vocab, hidden = 160, 256  # 160 rows: the int4 layout pads them to 192
    emb = VocabEmbedding(vocab, hidden, quant_method=GGUFEmbeddingMethod())
    head = LMHead(vocab, hidden, tied_to=emb)
    t, ref = gguf_tensor(qtype, vocab, hidden, 6)
    emb.load_weight("weight", t)
    assert emb.weight.numel() == 0 and head.quant_method is emb.quant_method
    ids = torch.tensor([[0, 159, 7], [64, 65, 96]])
    rows = emb(ids)
    assert rows.shape == (2, 3, hidden)
    assert torch.equal(rows, ref[ids])  # exact in float32, whatever the storage
    assert type(emb.quant_method.part).__name__ == {T.Q6_K: q6k_part(torch.float32), T.F16: "DensePart"}.get(
        qtype, fp32_affine_part()
    )
    h = torch.randn(4, hidden, generator=torch.Generator().manual_seed(1))
    logits = head(h)
    assert logits.dtype == torch.float32 and logits.shape == (4, vocab)
    assert_fp32_linear_close(logits, h, ref)
    if not tiled_gemv.rounds_x():  # float32 h: the leading candidates are float32 dot products
        top = logits.topk(8, dim=1).indices
        # a few ulps of another summation order (bmm vs mm), not bf16's 3 digits; seeded: an atol of
        # 5e-6 on unseeded h failed 3 runs in 10 where the top logits reached ~40
        torch.testing.assert_close(logits.gather(1, top), (h @ ref.t()).gather(1, top), rtol=1e-6, atol=1e-5)


def test_untied_embedding_keeps_other_types_raw_for_lookups():
    emb = VocabEmbedding(
        160, 256, dtype=torch.bfloat16, quant_method=GGUFConfig().embedding_method("model.embed_tokens")
    )
    t, ref = gguf_tensor(T.Q6_K, 160, 256, 8)
    emb.load_weight("weight", t)
    assert type(emb.quant_method.part).__name__ == "RawPart"
    ids = torch.tensor([3, 150])
    assert torch.equal(emb(ids), ref[ids].bfloat16())
    assert GGUFConfig().embedding_method("lm_head").serves_head


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_untied_q6_k_head_is_packed_and_refines_its_top_rows(dtype):
    head = LMHead(160, 256, dtype=dtype, quant_method=GGUFConfig().embedding_method("lm_head"))
    t, ref = gguf_tensor(T.Q6_K, 160, 256, 9)
    head.load_weight("weight", t)
    part = head.quant_method.part
    assert type(part).__name__ == q6k_part(dtype) and head.weight.numel() == 0
    h = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    exact = F.linear(h.float(), ref)
    logits = head(h)
    if dtype == torch.float32:  # exact float32 products, or (AVX2 build) x rounded to int16 steps as in every layer
        assert_fp32_linear_close(logits, h, ref)
    else:  # the top candidates come from rows(): float32 products of the bf16-scaled weights
        top = exact.topk(3, dim=1).indices
        torch.testing.assert_close(logits.gather(1, top), exact.gather(1, top), rtol=0, atol=0.02)
        assert torch.equal(logits.argmax(1), exact.argmax(1))


# ---- whole models -------------------------------------------------------------------------------


def write_gguf(path, arch: str, meta: dict, tensors: dict) -> str:
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        (w.add_float32 if isinstance(value, float) else w.add_uint32)(key, value)
    for name, (qtype, array) in tensors.items():
        w.add_tensor(name, array, raw_dtype=qtype if array.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def tiny_mixed_gguf(path, arch="llama", tied=True, layers=2, experts=0):
    """A small model whose weights use every type the packed path distinguishes."""
    H, heads, kv, hd, ffn, vocab = 256, 4, 2, 64, 512, 160
    meta = {
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": H,
        f"{arch}.feed_forward_length": ffn,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.vocab_size": vocab,
    }
    if experts:
        meta |= {
            f"{arch}.expert_count": experts,
            f"{arch}.expert_used_count": 2,
            f"{arch}.expert_feed_forward_length": ffn,
        }
    rng = np.random.default_rng(0)
    seed = iter(range(1000))

    def q(qtype, rows, cols, std=0.05):
        return qtype, random_blocks(qtype, rows, cols, next(seed), std)

    def norm(n):
        return T.F32, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    tensors = {"token_embd.weight": q(T.Q8_0, vocab, H, 1.0), "output_norm.weight": norm(H)}
    if not tied:
        tensors["output.weight"] = q(T.Q6_K, vocab, H)
    for b in range(layers):
        p = f"blk.{b}."
        tensors |= {
            p + "attn_norm.weight": norm(H),
            p + "attn_q.weight": q(T.Q4_K, heads * hd, H),
            p + "attn_k.weight": q(T.Q4_0, kv * hd, H),
            p + "attn_v.weight": q(T.Q6_K, kv * hd, H),
            p + "attn_output.weight": q(T.Q4_1 if b == 0 else T.BF16, H, heads * hd),
            p + "ffn_norm.weight": norm(H),
        }
        if arch == "qwen2":
            tensors |= {
                p + f"attn_{x}.bias": (T.F32, rng.standard_normal(n).astype(np.float32) * 0.1)
                for x, n in (("q", heads * hd), ("k", kv * hd), ("v", kv * hd))
            }
        if arch == "qwen3moe":
            tensors |= {p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd)}
        if experts:
            tensors |= {
                p + "ffn_gate_inp.weight": (T.F32, rng.standard_normal((experts, H)).astype(np.float32)),
                p + "ffn_gate_exps.weight": (T.Q8_0, random_blocks(T.Q8_0, experts * ffn, H).reshape(experts, ffn, -1)),
                p + "ffn_up_exps.weight": (T.Q4_K, random_blocks(T.Q4_K, experts * ffn, H).reshape(experts, ffn, -1)),
                p + "ffn_down_exps.weight": (T.Q6_K, random_blocks(T.Q6_K, experts * H, ffn).reshape(experts, H, -1)),
            }
        else:
            tensors |= {
                p + "ffn_gate.weight": q(T.Q8_0, ffn, H),
                p + "ffn_up.weight": (T.F16, random_blocks(T.F16, ffn, H)),
                p + "ffn_down.weight": q(T.Q6_K, H, ffn),
            }
    return write_gguf(path, arch, meta, tensors)


def build(path, packed: bool, dtype=torch.float32, kernels=None):
    """kernels: the CpuKernels the packed methods take (default: the defaults)."""
    from ember.config.model_config import ModelConfig
    from ember.kernels.cpu_kernels import CpuKernels
    from ember.loader.gguf import GGUFCheckpoint
    from ember.models.registry import get_model_class

    ckpt = GGUFCheckpoint(path)
    cfg = ModelConfig.from_dict(ckpt.config)
    quant = GGUFConfig() if packed else None
    if quant is not None:
        quant.kernels = kernels or CpuKernels()  # as resolve_quant_config sets it
    more = {} if kernels is None else {"kernels": kernels}  # the model's own (its experts take them)
    model = get_model_class(cfg.architecture)(cfg, dtype=dtype, device="cpu", quant_config=quant, **more)
    model.load_weights(ckpt.iter_weights(packed=packed))
    process_weights_after_loading(model)
    return model.eval()


@pytest.mark.parametrize("arch,tied,experts", [("llama", True, 0), ("qwen2", False, 0), ("qwen3moe", True, 4)])
def test_tiny_mixed_model_packed_equals_dequantized(tmp_path, arch, tied, experts):
    path = tiny_mixed_gguf(tmp_path / f"{arch}.gguf", arch, tied, experts=experts)
    # experts: the tiled parts' form (--no-cpu-block-gemv), exact up to summation order; with the block kernel
    # (the CPU default) they are the file's blocks over int8-rounded x, as llama.cpp runs them: against
    # llama.cpp in tests/quant/test_block_types_llamacpp.py and tests/loader/test_gguf_qwen4.py
    packed, dense = build(path, True, kernels=CpuKernels(block_gemv=False)), build(path, False)
    affine = fp32_affine_part()
    assert type(packed.model.layers[0].self_attn.qkv_proj.gguf_parts[0]).__name__ == affine
    if experts:  # gate Q8_0 + up Q4_K: two affine parts; down Q6_K: a Q6_K part
        parts = packed.model.layers[0].mlp.experts
        names = [type(p).__name__ for p in parts.parts13[3] + parts.parts2[3]]
        assert names == [affine, affine, q6k_part(torch.float32)]
        assert parts.w13.numel() == 0 and not parts.pending
        blocks = build(path, True).model.layers[0].mlp.experts  # the default: one block_moe call a layer
        assert [t.name for t in blocks.block_types] == ["Q8_0", "Q4_K", "Q6_K"] and not blocks.parts13
    outs = []
    for model in (packed, dense):
        seqs = [Seq(prompt=[3, 17, 99, 150, 42, 8, 0, 77], max_new=6), Seq(prompt=[5, 6], max_new=6)]
        driver = PagedDriver(model)
        first = driver.step([(s, len(s.prompt)) for s in seqs])
        for s, logits in zip(seqs, first):
            s.tokens.append(int(logits[-1].argmax()))
        driver.generate(seqs)
        outs.append((first, [s.generated for s in seqs]))
    # logits ~100: fp32 summation-order noise only, plus where the tiled GEMV's AVX2 build rounds x to
    # int16 steps (2^-16 of a group's largest) what that does through the layers (measured <= 3.3e-4)
    rel = 1e-3 if tiled_gemv.rounds_x() else 1e-5
    for a, b in zip(outs[0][0], outs[1][0]):
        torch.testing.assert_close(a, b, rtol=0, atol=rel * float(b.abs().max()))
    assert outs[0][1] == outs[1][1]


@pytest.mark.parametrize("arch,experts", [("llama", 0), ("qwen3moe", 4)])
def test_packed_iteration_equals_the_dequantized_one(tmp_path, arch, experts):
    from ember.loader.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(tiny_mixed_gguf(tmp_path / "m.gguf", arch, experts=experts))
    in_file = {t.tensor_type.name for t in ck._reader.tensors}
    assert {"Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0", "BF16", "F32"} <= in_file and ("F16" in in_file) == (not experts)
    packed, dense = dict(ck.iter_weights(packed=True)), dict(ck.iter_weights())
    assert packed.keys() == dense.keys()
    kinds = set()
    for name, w in packed.items():  # quantized matrices as blocks, float types as tensors
        kinds.add(w.qtype.name if isinstance(w, GGUFTensor) else str(w.dtype))
        assert torch.equal(w.dequantize() if isinstance(w, GGUFTensor) else w, dense[name]), name
    # BF16 and F16 matrices in their own dtype (no float32 copy at load), the rest float32
    halves = {"torch.bfloat16"} | ({"torch.float16"} if not experts else set())
    assert kinds == {"Q4_0", "Q4_1", "Q4_K", "Q6_K", "Q8_0", "torch.float32"} | halves
    assert packed["model.norm.weight"].dtype == torch.float32  # 1-D and float tensors stay tensors


def test_packed_llama_qk_rows_are_unpermuted_like_the_dequantized_ones(tmp_path):
    from ember.loader.gguf import GGUFCheckpoint, _unpermute_rows

    ck = GGUFCheckpoint(tiny_mixed_gguf(tmp_path / "l.gguf", layers=1))
    packed, dense = dict(ck.iter_weights(packed=True)), dict(ck.iter_weights())
    for part, heads in (("q", 4), ("k", 2)):
        t = ck._reader.tensors[[x.name for x in ck._reader.tensors].index(f"blk.0.attn_{part}.weight")]
        in_file = torch.from_numpy(np.asarray(gguf_dequantize(t.data, t.tensor_type)).copy())
        got = packed[f"model.layers.0.self_attn.{part}_proj.weight"].dequantize()
        assert torch.equal(got, _unpermute_rows(in_file, heads)) and not torch.equal(got, in_file)
        assert torch.equal(got, dense[f"model.layers.0.self_attn.{part}_proj.weight"])


# ---- the default model ---------------------------------------------------------------------------


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@pytest.fixture(scope="module")
def default_model():
    from ember.default_model import default_model_path
    from ember.loader.gguf import GGUFCheckpoint

    return GGUFCheckpoint(default_model_path())


def _last_logits(model, tok, prompts):
    seqs = [Seq(prompt=tok.encode(p), max_new=1) for p in prompts]
    work = [(s, len(s.prompt)) for s in seqs]
    return torch.stack([lg[-1] for lg in PagedDriver(model, num_blocks=64, block_size=16).step(work)])


@pytest.fixture(scope="module")
def reference_logits(default_model, one_thread):  # noqa: F811 (the fixture imported above)
    """Last-token logits of the dequantized fp32 model (quantization none)."""
    return _last_logits(build(default_model.path, False), default_model.tokenizer(), PROMPTS)


@pytest.mark.slow
def test_default_model_packed_fp32_logits_match_dequantized(default_model, reference_logits):
    from ember.loader.model_loader import resident_weight_bytes

    packed = build(default_model.path, True)
    got = _last_logits(packed, default_model.tokenizer(), PROMPTS)
    # Exact weights; only the summation order differs (the logits are ~20 in size), and where the tiled
    # GEMV's AVX2 build rounds x to int16 steps, that (measured: up to 0.0053)
    torch.testing.assert_close(got, reference_logits, rtol=0, atol=1e-2 if tiled_gemv.rounds_x() else 1e-3)
    assert torch.equal(got.argmax(-1), reference_logits.argmax(-1))
    # fp32 runs hold the int4 scales in fp32: more than the file, still a third of dense fp32
    assert resident_weight_bytes(packed) < 1.35 * default_model.tensor_bytes


@pytest.mark.slow
def test_default_model_packed_bf16_is_as_close_to_fp32_as_dense_bf16(default_model, reference_logits):
    errors = {}
    for packed in (True, False):
        got = _last_logits(build(default_model.path, packed, torch.bfloat16), default_model.tokenizer(), PROMPTS)
        assert torch.equal(got.argmax(-1), reference_logits.argmax(-1))
        errors[packed] = (got - reference_logits).abs().max().item()
    # bf16 activations dominate: the bf16-rounded block scales add little on top
    assert errors[True] < 1.5 * errors[False] + 0.05, errors


@pytest.mark.engine
def test_default_model_served_packed_by_default_within_the_memory_budget(default_model):
    from ember import LLM, SamplingParams

    llm = LLM(kv_cache_memory=0.05, max_model_len=512, dtype="bfloat16", num_threads=1)
    loaded = llm.engine.parts.loaded
    assert loaded.quantization == "gguf" and llm.engine.parts.copies.int8_decode_bytes == 0
    assert loaded.weight_bytes <= 1.15 * default_model.tensor_bytes
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert "Paris" in outs[0].outputs[0].text
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
