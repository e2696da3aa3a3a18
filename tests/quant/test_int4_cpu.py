"""Int4Weight: torch's CPU int4 kernel layout built directly, exact affine repack, both execution paths."""

import pytest
import torch

from ember.quant.gemm_dispatch import INT4_KERNEL_MAX_ROWS as KERNEL_MAX_ROWS
from ember.quant.int4_cpu import Int4Weight, pack_int4_codes, unpack_int4_codes


def _random(N=192, K=256, G=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (N, K), generator=g)
    scale = torch.rand(N, K // G, generator=g) * 0.05 + 1e-3
    offset = -torch.rand(N, K // G, generator=g) * 0.4
    W = (q.float().view(N, K // G, G) * scale[..., None] + offset[..., None]).view(N, K)
    return q, scale, offset, W


def test_packing_equals_torchs_converter_and_unpacks():
    q, *_ = _random()
    packed = pack_int4_codes(q)
    assert torch.equal(packed, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2))
    assert torch.equal(unpack_int4_codes(packed, *q.shape), q.to(torch.uint8))


@pytest.mark.parametrize("G", [32, 64, 128])
def test_fp32_is_exact_on_both_paths(G):
    q, scale, offset, W = _random(G=G)
    w = Int4Weight.from_affine(q, scale, offset, G, torch.float32)
    torch.testing.assert_close(w.dequantize(), W, rtol=0, atol=1e-6)
    for rows in (1, 5, KERNEL_MAX_ROWS + 8):  # kernel path, and dequantize + GEMM above the cutoff
        x = torch.randn(rows, W.shape[1])
        torch.testing.assert_close(w.linear(x), x @ W.t(), rtol=1e-5, atol=1e-4)


def test_bf16_holds_scales_in_bf16_within_rounding():
    """The kernel takes scales in the activation dtype: bf16 rounds them (relative 2^-9)."""
    q, scale, offset, W = _random(G=32)
    w = Int4Weight.from_affine(q, scale, offset, 32, torch.bfloat16)
    assert w.scales_zeros.dtype == torch.bfloat16
    err = (w.dequantize(torch.float32) - W).abs()
    assert err.max() <= 8 * scale.max() * 2**-8 + (offset + 8 * scale).abs().max() * 2**-8
    x = torch.randn(3, W.shape[1], dtype=torch.bfloat16)
    torch.testing.assert_close(w.linear(x).float(), x.float() @ w.dequantize(torch.float32).t(), rtol=2e-2, atol=2e-2)
