"""The fp8 block-scaled weight CPU kernel (ember/kernels/cpu_fp8_gemv.*): both of its paths (the GEMV, the
decoded panels + torch's GEMM) against the torch reference (fp8_blocks.dequantize: weight * its block
scale, in float32) @ x in float64, at odd shapes with partial edge blocks and fused parts that start
mid-block; every e4m3 byte; its refusals; and its AVX2 build on this machine's tests."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_fp8_gemv
from ember.kernels.cpp_build import has_cpu_flags
from ember.quant import fp8_blocks
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(not cpu_fp8_gemv.available(), reason="needs AVX2 + FMA + F16C and a C++ compiler")
BIG = 1 << 30  # gemv_max_rows that keeps every row count on the GEMV


def fused_weight(parts: list[int], K: int, block: tuple[int, int], seed: int):
    """Parts quantized each on its own block grid and fused as ember fuses them: (weight, scale, scale_row)."""
    g = torch.Generator().manual_seed(seed)
    rows, weights = [], []
    for n in parts:
        q, s = fp8_blocks.quantize(torch.randn(n, K, generator=g) * torch.rand(n, 1, generator=g), block)
        weights.append(q)
        rows.append(fp8_blocks.expand_rows(s, n, block[0]))
    scale, scale_row = fp8_blocks.fold_rows(torch.cat(rows))
    return torch.cat(weights), scale, scale_row


@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize(
    ("parts", "K", "block"),
    [([37], 1003, (128, 128)), ([40, 24, 24], 200, (32, 32)), ([5], 7, (32, 32)), ([9, 13], 100, (48, 24))],
)
@pytest.mark.parametrize("gemv_max_rows", [BIG, 0])
def test_both_paths_give_the_float32_products_of_the_scaled_weights(M, parts, K, block, gemv_max_rows):
    w, scale, scale_row = fused_weight(parts, K, block, seed=M * 7 + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M))
    wd = fp8_blocks.dequantize(w, scale, scale_row, block[1])
    y = cpu_fp8_gemv.linear(x, w, scale, scale_row, block[1], gemv_max_rows)
    assert y.dtype == torch.float32 and y.shape == (M, sum(parts))
    # the products weight * scale are the reference's float32 ones; only the order of the sums differs
    bound = 4 * K * torch.finfo(torch.float32).eps * (x.abs().double() @ wd.abs().double().t())
    assert ((y.double() - x.double() @ wd.double().t()).abs() <= bound + 1e-30).all()


def test_every_e4m3_byte_decodes_exactly():
    """A one-hot x reads the weight's columns back: all 254 finite e4m3 values (subnormals included), on the
    vector steps and the scalar tail alike."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn).reshape(1, -1).repeat(5, 1)
    K = w.shape[1]
    y = cpu_fp8_gemv.linear(torch.eye(K)[:3], w, torch.full((1, 1), 0.5), torch.zeros(5, dtype=torch.int32), 256, BIG)
    assert torch.equal(y[:, 0], w[0, :3].float() * 0.5)
    y = cpu_fp8_gemv.linear(torch.eye(K), w, torch.ones(1, 1), torch.zeros(5, dtype=torch.int32), 256, BIG)
    assert torch.equal(y[:, 0], w[0].float())


def test_empty_and_refused_inputs():
    w, scale, scale_row = fused_weight([5], 16, (32, 32), seed=0)
    assert cpu_fp8_gemv.linear(torch.randn(0, 16), w, scale, scale_row, 32, BIG).shape == (0, 5)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_fp8_gemv.linear(torch.randn(2, 16).bfloat16(), w, scale, scale_row, 32, BIG)
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        cpu_fp8_gemv.linear(torch.randn(2, 16), w.float(), scale, scale_row, 32, BIG)
    with pytest.raises(RuntimeError, match="scale must be"):
        cpu_fp8_gemv.linear(torch.randn(2, 16), w, scale, scale_row, 8, BIG)
    with pytest.raises(RuntimeError, match="outside the scale"):
        cpu_fp8_gemv.linear(torch.randn(2, 16), w, scale, scale_row + 1, 32, BIG)


def test_compiled_graph_calls_the_op():
    """torch.compile traces the op through its fake (an opaque call): same values as eager."""
    w, scale, scale_row = fused_weight([24], 64, (32, 32), seed=1)
    x = torch.randn(3, 64)
    fn = torch.compile(lambda a: cpu_fp8_gemv.linear(a, w, scale, scale_row, 32, BIG) * 2, backend="eager")
    torch.testing.assert_close(fn(x), cpu_fp8_gemv.linear(x, w, scale, scale_row, 32, BIG) * 2)


def test_avx2_build_passes_this_module():
    """Where this machine targets AVX-512, the kernel is compiled -march=haswell (what an AVX2-only CPU
    builds: 16 weights a step instead of 32) under the name this machine looks for, and this module's other
    tests run against it in a child that reads the CPU flags as such a machine's."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build("cpu_fp8_gemv.cpp")
    run = avx2_child.run_module(env, __file__)
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-3000:]
