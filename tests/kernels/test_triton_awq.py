"""Triton AWQ GEMM and dequantize kernels against the exact torch reference (dequantize_awq).

Without a GPU these run under the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors. Triton
reads TRITON_INTERPRET when a function is decorated with @triton.jit, not per launch, so the
fixture sets it before the first call and ember.kernels.triton_awq builds (and caches) its
kernels per value of the variable. Known interpreter gap (triton 3.9): bfloat16 is stored as
uint16 and tl.dot multiplies the raw bits (triton-lang/triton#11584, "not supported yet"), and
fp32 -> bf16 casts truncate, so bf16 is tested only on a GPU. Sizes are tiny: the interpreter
costs about 0.5 ms per program instance and op.
"""

from __future__ import annotations

import pytest
import torch

from ember.quant.awq_packing import dequantize_awq, pack_linear

pytest.importorskip("triton")

from ember.kernels import triton_awq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture(scope="module", autouse=True)
def interpreter_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        yield


def awq_tensors(K: int, N: int, G: int, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    w = torch.randn(N, K) * torch.rand(N, 1)  # rows of different scales
    return {k: v.to(DEVICE) for k, v in pack_linear(w, G).items()}


@pytest.mark.parametrize(
    "M, K, N, G",
    [
        (1, 128, 72, 32),  # one row (decode), N not a power of two
        (33, 128, 200, 64),  # a row past one 32-row tile, N % 64 != 0
        (5, 256, 64, 128),
        (16, 96, 40, 96),  # group_size -1: one group over the whole input
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_matches_dequantized_matmul(M, K, N, G, dtype):
    t = awq_tensors(K, N, G, seed=M)
    x = torch.randn(M, K, device=DEVICE).to(dtype)
    wd = dequantize_awq(t["qweight"], t["qzeros"], t["scales"].float(), G)  # exact in fp32
    ref = x.float() @ wd.to(dtype).float()  # the weights the kernel feeds tl.dot, fp32 sums
    y = triton_awq.awq_gemm(x, t["qweight"], t["qzeros"], t["scales"], G)
    assert y.shape == (M, N) and y.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = (y.float() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), f"max |dy| {err:.3g} vs max |y| {ref.abs().max():.3g}"


@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_split_k_sums_to_the_same_result(split_k):
    t = awq_tensors(256, 72, 32)
    x = torch.randn(3, 256, device=DEVICE)
    ref = x @ dequantize_awq(t["qweight"], t["qzeros"], t["scales"].float(), 32)
    y = triton_awq.awq_gemm(x, t["qweight"], t["qzeros"], t["scales"], 32, split_k=split_k)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("K, N, G", [(64, 72, 32), (128, 200, 64), (256, 64, 128)])
def test_dequantize_is_exact(K, N, G):
    t = awq_tensors(K, N, G)
    args = (t["qweight"], t["qzeros"], t["scales"], G)
    assert torch.equal(triton_awq.awq_dequantize(*args), dequantize_awq(*args))  # fp16, bit-exact with AutoAWQ
    exact32 = dequantize_awq(t["qweight"], t["qzeros"], t["scales"].float(), G)
    assert torch.equal(triton_awq.awq_dequantize(*args, dtype=torch.float32), exact32)


def test_nibble_order_worked_example():
    """formats.md §1.3: logical columns [4,6,6,8,5,5,5,2] are the word 0x25865564."""
    qweight = torch.full((16, 1), 0x25865564, dtype=torch.int32, device=DEVICE)
    qzeros = torch.zeros((1, 1), dtype=torch.int32, device=DEVICE)
    scales = torch.ones((1, 8), dtype=torch.float16, device=DEVICE)
    w = triton_awq.awq_dequantize(qweight, qzeros, scales, 16)
    assert w[0].tolist() == [4, 6, 6, 8, 5, 5, 5, 2]


def test_mismatched_tensors_are_refused():
    t = awq_tensors(64, 72, 32)
    with pytest.raises(ValueError, match="disagree"):
        triton_awq.awq_gemm(torch.randn(1, 64, device=DEVICE), t["qweight"], t["qzeros"], t["scales"], 64)
