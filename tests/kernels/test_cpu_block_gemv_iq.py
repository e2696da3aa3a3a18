"""The grid-coded IQ types of the block GEMV (ember/kernels/cpu_block_gemv_iq.cpp: IQ3_XXS, IQ3_S, IQ2_XXS,
IQ2_XS, IQ2_S, IQ1_S, IQ1_M) on random valid blocks (every byte random but the float16 scale, finite; IQ1_M's
spread across the top nibbles of its scale words): the row dequantizer is gguf-py's reference bit for bit, and
the GEMM (the AVX2 dots here) is the float64 product of the Q8K-rounded activations and those values, as are
the scalar reference dots, at odd row counts and several blocks a row."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ember.kernels import cpu_block_gemv

pytestmark = pytest.mark.skipif(not cpu_block_gemv.available(), reason="needs a C++ compiler")
IQ_TYPES = ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
ops = torch.ops.ember_cpu


def random_blocks(qtype: str, rows: int, blocks: int, seed: int) -> np.ndarray:
    """[rows, blocks * block_bytes] uint8: random bytes with a finite float16 scale (N(0, 0.01)) in place."""
    t = GGMLQuantizationType[qtype]
    size = GGML_QUANT_SIZES[t][1]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks, size), dtype=np.uint8)
    d = (rng.standard_normal(rows * blocks) * 0.01).astype(np.float16)
    if qtype == "IQ1_M":  # the scale's 4 nibbles are the top nibbles of the 4 scale words (bytes 48..55)
        words = raw[:, 48:56].copy().view(np.uint16) & np.uint16(0x0FFF)
        for k in range(4):
            words[:, k] |= ((d.view(np.uint16) >> np.uint16(4 * k)) & np.uint16(0xF)) << np.uint16(12)
        raw[:, 48:56] = words.view(np.uint8)
    else:
        raw[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("qtype", IQ_TYPES)
def test_dequant_rows_are_gguf_pys_values_bit_for_bit(qtype):
    raw = random_blocks(qtype, rows=5, blocks=3, seed=len(qtype))
    t = GGMLQuantizationType[qtype]
    want = gguf_dequantize(raw.reshape(-1), t).astype(np.float32).reshape(5, -1)
    got = ops.block_dequant_rows(torch.from_numpy(raw), int(t))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))


@pytest.mark.parametrize("qtype", IQ_TYPES)
@pytest.mark.parametrize(("M", "N", "blocks"), [(1, 7, 3), (3, 5, 1), (9, 33, 2)])
def test_gemm_is_the_product_of_the_rounded_activations_and_the_dequantized_rows(qtype, M, N, blocks):
    """Both the AVX2 dots (block_gemm) and the scalar ones (block_gemm_scalar) against float64: integer sums
    inside a block are exact, so only the float sums of the per-block products differ."""
    t = int(GGMLQuantizationType[qtype])
    w = torch.from_numpy(random_blocks(qtype, rows=N, blocks=blocks, seed=M * 100 + N))
    x = torch.randn(M, 256 * blocks, generator=torch.Generator().manual_seed(N))
    wd = ops.block_dequant_rows(w, t).double()
    xq = ops.block_quantize_act(x, t).double()
    want = xq @ wd.t()
    bound = 1e-5 * (xq.abs() @ wd.abs().t()) + 1e-30
    for gemm in (ops.block_gemm, ops.block_gemm_scalar):
        got = gemm(x, w, t, True)
        assert got.shape == (M, N) and got.dtype == torch.float32
        assert ((got.double() - want).abs() <= bound).all(), gemm


def test_set_iq_table_refuses_unknown_names_and_wrong_sizes():
    assert not ops.block_set_iq_table("no_such_grid", torch.zeros(16, dtype=torch.uint8))
    assert not ops.block_set_iq_table("iq2xxs_grid", torch.zeros(16, dtype=torch.uint8))
