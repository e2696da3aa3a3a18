"""The Triton fp8 GEMM (ember/kernels/triton_fp8.py) against the torch reference (fp8_blocks.dequantize: weight
* its block scale, in float32) @ x, at odd shapes with partial edge blocks, a fused layer whose parts start
mid-block (scale_row), several rows (split-K and not), and every e4m3 byte value.

Without a GPU it runs under the Triton interpreter (TRITON_INTERPRET=1) on CPU tensors, set before the first
call (tests/kernels/test_triton_awq.py says why); bf16 runs only on a GPU (the interpreter's bf16 tl.dot gap)."""

from __future__ import annotations

import pytest
import torch

from ember.quant import fp8_blocks

pytest.importorskip("triton")

from ember.kernels import triton_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.fixture(scope="module", autouse=True)
def interpreter_on_cpu():
    with pytest.MonkeyPatch.context() as mp:
        if DEVICE == "cpu":
            mp.setenv("TRITON_INTERPRET", "1")
        yield


def fused_weight(parts: list[int], K: int, block: tuple[int, int], seed: int):
    """Parts quantized each on its own block grid, fused as ember fuses them: (weight, scale, scale_row)."""
    g = torch.Generator().manual_seed(seed)
    rows, weights = [], []
    for n in parts:
        q, s = fp8_blocks.quantize(torch.randn(n, K, generator=g) * torch.rand(n, 1, generator=g), block)
        weights.append(q)
        rows.append(fp8_blocks.expand_rows(s, n, block[0]))
    scale, scale_row = fp8_blocks.fold_rows(torch.cat(rows))
    return torch.cat(weights), scale, scale_row


@pytest.mark.parametrize(
    "M, parts, K, block",
    [
        (1, [72], 128, (128, 128)),  # one row (decode: split K), one partial row block
        (3, [40, 24, 24], 100, (32, 32)),  # q | k | v starting mid-block, K's last block partial
        (33, [50], 96, (16, 48)),  # a row past one 32-row tile; 48-wide blocks, 16-wide K tiles
        (20, [130, 7], 64, (128, 64)),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_matches_the_dequantized_reference(M, parts, K, block, dtype):
    w, scale, scale_row = fused_weight(parts, K, block, seed=M)
    x = torch.randn(M, K).to(dtype)
    wd = fp8_blocks.dequantize(w, scale, scale_row, block[1]).to(dtype)
    ref = x.float() @ wd.float().t()
    y = triton_fp8.fp8_linear(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), scale_row.to(DEVICE), block[1])
    assert y.shape == (M, sum(parts)) and y.dtype == dtype
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    err = (y.float().cpu() - ref).abs().max().item()
    assert err <= tol * ref.abs().max().item(), f"max |dy| {err:.3g} vs max |y| {ref.abs().max():.3g}"


def test_every_e4m3_byte_decodes_exactly():
    """A one-hot x reads the weight's columns back: all 254 finite e4m3 values, subnormals included."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    w = codes.view(torch.float8_e4m3fn).reshape(1, -1).repeat(16, 1)
    K = w.shape[1]
    scale = torch.ones(1, 1)
    y = triton_fp8.fp8_linear(
        torch.eye(K).to(DEVICE), w.to(DEVICE), scale.to(DEVICE), torch.zeros(16, dtype=torch.int32).to(DEVICE), 256
    )
    assert torch.equal(y[:, 0].cpu(), w[0].float())


def test_a_block_no_k_tile_divides_is_refused():
    """ember.quant.fp8_linear.fp8_matmul asks block_k_for first and dequantizes for such blocks."""
    w, scale, scale_row = fused_weight([9], 50, (8, 24), seed=5)
    assert triton_fp8.block_k_for(24) is None and triton_fp8.block_k_for(128) == 64
    with pytest.raises(ValueError, match="multiple of 16"):
        triton_fp8.fp8_linear(torch.randn(2, 50), w, scale, scale_row, 24)
