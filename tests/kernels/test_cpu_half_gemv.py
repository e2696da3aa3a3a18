"""The 16-bit-weight CPU kernel (ember/kernels/cpu_half_gemv.*): bf16 and fp16 weights under float32 x,
both of its paths (the GEMV, the widened panels + torch's GEMM) against a float64 product of the same
values at odd shapes, its refusals, and its AVX2 build on this machine's tests."""

from __future__ import annotations

import pytest
import torch

from ember.kernels import cpu_half_gemv
from ember.kernels.cpp_build import has_cpu_flags
from tests.kernels import avx2_child

pytestmark = pytest.mark.skipif(not cpu_half_gemv.available(), reason="needs AVX2 + FMA + F16C and a C++ compiler")
BIG = 1 << 30  # gemv_max_rows that keeps every row count on the GEMV


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().t()).float()


@pytest.mark.parametrize("dtype", cpu_half_gemv.DTYPES)
@pytest.mark.parametrize("M", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize(("N", "K"), [(37, 1003), (8, 16), (19, 2085), (1, 7)])
@pytest.mark.parametrize("gemv_max_rows", [BIG, 0])
def test_both_paths_give_the_float32_products_of_the_weights(dtype, M, N, K, gemv_max_rows):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g).to(dtype)
    y = cpu_half_gemv.linear(x, w, gemv_max_rows)
    assert y.dtype == torch.float32 and y.shape == (M, N)
    # the products are exact in float32; only the order of the float32 sums differs from float64's
    bound = 4 * K * torch.finfo(torch.float32).eps * (x.abs().double() @ w.abs().double().t()).float()
    assert ((y - reference(x, w)).abs() <= bound + 1e-30).all()


def test_rows_at_the_crossover_agree_between_paths():
    """The engine switches path at gemm_dispatch.HALF_GEMV_MAX_ROWS: the two agree to float32 sums."""
    from ember.quant.gemm_dispatch import HALF_GEMV_MAX_ROWS

    g = torch.Generator().manual_seed(1)
    x = torch.randn(HALF_GEMV_MAX_ROWS + 1, 1024, generator=g)
    w = torch.randn(300, 1024, generator=g).bfloat16()
    a, b = cpu_half_gemv.linear(x, w, BIG), cpu_half_gemv.linear(x, w, 0)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)


def test_empty_and_refused_inputs():
    w = torch.randn(5, 16).bfloat16()
    assert cpu_half_gemv.linear(torch.randn(0, 16), w, BIG).shape == (0, 5)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_half_gemv.linear(torch.randn(2, 16).bfloat16(), w, BIG)
    with pytest.raises(RuntimeError, match="bf16 or fp16"):
        cpu_half_gemv.linear(torch.randn(2, 16), w.float(), BIG)
    with pytest.raises(RuntimeError, match="columns"):
        cpu_half_gemv.linear(torch.randn(2, 15), w, BIG)


def test_compiled_graph_calls_the_op():
    """torch.compile traces the op through its fake (an opaque call): same values as eager."""
    x, w = torch.randn(3, 64), torch.randn(24, 64).bfloat16()
    fn = torch.compile(lambda a: cpu_half_gemv.linear(a, w, BIG) * 2, backend="eager", fullgraph=True)
    torch.testing.assert_close(fn(x), cpu_half_gemv.linear(x, w, BIG) * 2)


def test_avx2_build_passes_this_module():
    """Where this machine targets AVX-512, the kernel is compiled -march=haswell (what an AVX2-only CPU
    builds) under the name this machine looks for, and this module's other tests run against it in a
    child that reads the CPU flags as such a machine's (tests/kernels/haswell_flags.py)."""
    if not has_cpu_flags("avx512f"):
        pytest.skip("this machine's own build is the AVX2 one")
    env = avx2_child.build("cpu_half_gemv.cpp")
    run = avx2_child.run_module(env, __file__)
    ok = run.returncode == 0 and " passed" in run.stdout and "skipped" not in run.stdout  # every test ran
    assert ok, run.stdout[-3000:] + run.stderr[-3000:]
