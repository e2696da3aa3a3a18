"""GGUF matrices and MoE experts of the block-kernel types (Q2_K, Q3_K, IQ4_NL, IQ4_XS, the IQ grids) kept as
the file's own blocks (ember.quant.gguf_block_part, GGUFExperts' block mode) instead of dense: the parts a
fused layer gets, their products against the dequantized weights, exact lookups, and --no-cpu-block-gemv
bringing the dense path back. Whole files against llama.cpp: test_block_types_llamacpp.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from ember.kernels import cpu_block_gemv
from ember.kernels.cpu_kernels import CpuKernels
from ember.quant.gguf_block_part import BlockPart
from ember.quant.gguf_blocks import GGUFTensor
from ember.quant.gguf_quant import DensePart, GGUFExperts, pack_shards
from tests.kernels.test_cpu_block_gemv import random_blocks
from tests.models.tiny_models import one_thread  # noqa: F401 (fixture)

# Under load, two OpenMP threads spin-wait each other into ~100x slower small ops (test_gguf_packed.py).
pytestmark = [
    pytest.mark.skipif(not cpu_block_gemv.available(), reason="needs a C++ compiler"),
    pytest.mark.usefixtures("one_thread"),
]
NO_BLOCKS = CpuKernels(block_gemv=False)


def shard(qtype: T, rows: int, cols: int, seed: int) -> tuple[GGUFTensor, torch.Tensor]:
    raw = random_blocks(qtype, rows, cols, seed)
    return GGUFTensor(qtype, raw, (rows, cols)), torch.from_numpy(gguf_dequantize(raw, qtype).astype(np.float32))


def assert_rounded_x_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor):
    """y = x @ w^T up to x rounded to int8 per block: |error| <= sum |w| |x| / 254 (half a step of max|x| / 127)."""
    ref = x.double() @ w.double().t()
    bound = (x.double().abs().amax(-1, keepdim=True) / 254) @ w.double().abs().sum(1, keepdim=True).t()
    assert ((y.double() - ref).abs() <= bound + 1e-4 * ref.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_fused_layer_keeps_each_run_of_block_types_as_blocks(dtype):
    (q, wq), (k, wk), (v, wv) = shard(T.Q2_K, 32, 512, 1), shard(T.IQ4_NL, 16, 512, 2), shard(T.IQ4_NL, 16, 512, 3)
    parts = pack_shards([q, k, v], dtype, "cpu")
    assert [type(p).__name__ for p in parts] == ["BlockPart", "BlockPart"]
    assert [p.qtype for p in parts] == [T.Q2_K, T.IQ4_NL] and parts[1].N == 32
    w = torch.cat([wq, wk, wv])
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), w)  # gguf-py's values, nothing dense held
    assert sum(b.nbytes for p in parts for b in p.buffers()) == q.nbytes + k.nbytes + v.nbytes
    x = torch.randn(3, 5, 512).to(dtype)
    y = torch.cat([p.linear(x) for p in parts], dim=-1)
    assert y.dtype == dtype and y.shape == (3, 5, 64)
    assert_rounded_x_close(y.float().view(15, 64), x.float().view(15, 512), w)
    ids = torch.tensor([7, 0, 31])
    assert torch.equal(parts[0].rows(ids), wq[ids])
    assert parts[0].linear_float(x).dtype == torch.float32
    dense = pack_shards([q, k, v], dtype, "cpu", kernels=NO_BLOCKS)  # --no-cpu-block-gemv: as before
    assert [type(p) for p in dense] == [DensePart]


def test_a_lookup_only_embedding_keeps_block_types_as_blocks():
    t, w = shard(T.Q3_K, 40, 256, 4)
    (part,) = pack_shards([t], torch.bfloat16, "cpu", raw_ok=True)
    assert isinstance(part, BlockPart)
    assert torch.equal(part.rows(torch.tensor([39, 2, 2])), w[[39, 2, 2]])


def experts_of(types: tuple, kernels: CpuKernels, E=4, H=256, I=512) -> GGUFExperts:
    experts = GGUFExperts(E, H, I, torch.float32, kernels=kernels)
    for kind, qtype, (rows, cols) in zip(("gate", "up", "down"), types, ((I, H), (I, H), (H, I))):
        stacked, _ = shard(qtype, E * rows, cols, 10 + int(qtype))
        for e in range(E):  # as the loader hands a 3-D tensor out: per-expert slices of one map
            experts.load_weight(f"{e}.{kind}_proj.weight", stacked.narrow(0, e * rows, rows))
    experts.pack()
    return experts


@pytest.mark.parametrize("types", [(T.Q2_K, T.Q2_K, T.Q3_K), (T.IQ4_XS, T.IQ4_XS, T.Q4_K)])
def test_experts_of_block_types_run_in_one_block_moe_call(types):
    blocks, dense = experts_of(types, CpuKernels()), experts_of(types, NO_BLOCKS)
    assert blocks.block is not None and blocks.block_types == types and not blocks.parts13
    assert [tuple(b.shape[:2]) for b in blocks.block] == [(4, 512), (4, 512), (4, 256)]
    assert dense.block is None and type(dense.parts13[0][0]) is DensePart
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=g)
    ids = torch.tensor([[0, 2], [1, 2], [3, 0], [2, 1], [2, 3]])
    wts = torch.rand(5, 2, generator=g)
    y, ref = blocks(x, ids, wts), dense(x, ids, wts)
    # x and h rounded to int8 per block (as llama.cpp does): ~1% of the output's scale on random weights
    assert (y - ref).abs().max() <= 0.03 * ref.abs().max()
    one = blocks.expert_forward(2, x[:2])  # one expert alone (grouped paths, hot caches)
    assert (one - dense.expert_forward(2, x[:2])).abs().max() <= 0.03 * one.abs().max()


def test_experts_of_every_type_run_as_blocks_and_keep_their_parts_without_the_kernel():
    """The block kernel runs any quantized experts in one call a layer (the CPU default); --no-cpu-block-gemv
    keeps the tiled parts, and both give the same products but for x's int8 rounding."""
    blocks = experts_of((T.Q4_K, T.Q4_K, T.Q6_K), CpuKernels())
    parts = experts_of((T.Q4_K, T.Q4_K, T.Q6_K), CpuKernels(block_gemv=False))
    assert blocks.block is not None and not blocks.parts13
    assert parts.block is None and len(parts.parts13) == 4
    x, ids, w = torch.randn(2, 256), torch.tensor([[0, 1], [2, 3]]), torch.ones(2, 2)
    want = parts(x, ids, w)
    torch.testing.assert_close(blocks(x, ids, w), want, rtol=0, atol=2e-2 * float(want.abs().max()))


def test_the_planner_counts_block_types_at_the_files_bytes():
    from ember.engine.peak_rss import GGUFTensorInfo, held_bytes, needs_copy

    for name, per in (("Q2_K", 84 / 256), ("IQ4_NL", 18 / 32), ("IQ1_S", 50 / 256)):
        t = GGUFTensorInfo("blk.0.ffn_up.weight", name, 1 << 20, 2)
        assert held_bytes(t, 4, "tiled", False) == held_bytes(t, 2, "int4", False) == (1 << 20) * per
        assert not needs_copy(name, "tiled", any_rows=False)  # the kernel serves every row count
