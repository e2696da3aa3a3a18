"""Fused linears, RMSNorm and the MoE block vs plain torch / transformers modules."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.errors import ModelLoadError
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.activation import SiluAndMul
from ember.layers.embedding import LMHead, VocabEmbedding
from ember.layers.linear import MergedColumnLinear, QKVLinear, RowParallelLinear
from ember.layers.moe import SparseMoeBlock
from ember.layers.norm import RMSNorm
from tests.models.tiny_models import one_thread

pytestmark = pytest.mark.usefixtures(one_thread.__name__)


def test_qkv_linear_fuses_q_k_v_with_bias():
    torch.manual_seed(0)
    H, D, Hq, Hkv = 32, 8, 6, 2
    layer = QKVLinear(H, D, Hq, Hkv, bias=True)
    ws = {s: torch.randn(n * D, H) for s, n in (("q", Hq), ("k", Hkv), ("v", Hkv))}
    bs = {s: torch.randn(w.shape[0]) for s, w in ws.items()}
    for s in "kvq":  # any order
        layer.load_weight("weight", ws[s], s)
        layer.load_weight("bias", bs[s], s)
    x = torch.randn(5, H)
    q, k, v = layer.split(layer(x))
    assert q.shape == (5, Hq, D) and k.shape == (5, Hkv, D)
    for s, got in zip("qkv", (q, k, v)):
        torch.testing.assert_close(got.flatten(1), F.linear(x, ws[s], bs[s]))
    assert layer.expected_shards("weight") == {"q", "k", "v"}


def test_merged_gate_up_and_row_linear():
    torch.manual_seed(0)
    gate_up = MergedColumnLinear(16, [24, 24], dtype=torch.float64)
    down = RowParallelLinear(24, 16, dtype=torch.float64)
    wg, wu, wd = torch.randn(24, 16), torch.randn(24, 16), torch.randn(16, 24)
    gate_up.load_weight("weight", wu, "up")
    gate_up.load_weight("weight", wg, "gate")
    down.load_weight("weight", wd)
    assert gate_up.weight.dtype == torch.float64  # cast on load
    x = torch.randn(3, 16, dtype=torch.float64)
    y = down(SiluAndMul()(gate_up(x)))
    ref = F.linear(F.silu(F.linear(x, wg.double())) * F.linear(x, wu.double()), wd.double())
    torch.testing.assert_close(y, ref)


def test_shape_mismatch_raises():
    layer = MergedColumnLinear(16, [24, 24])
    with pytest.raises(ModelLoadError, match=r"\(20, 16\).*\(24, 16\)"):
        layer.load_weight("weight", torch.zeros(20, 16), "gate")
    with pytest.raises(ModelLoadError, match="shard"):
        layer.load_weight("weight", torch.zeros(24, 16), "q")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernels", [CpuKernels.none(), CpuKernels()], ids=["torch", "fused"])
def test_rmsnorm_bit_exact_with_hf(dtype, kernels):
    """The torch path is HF's bit for bit; the fused C++ kernel (where this CPU builds it) rounds as the torch
    ops do but sums the squares in another order: bit-exact in bf16 here, within a few float32 ulps in float32."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    torch.manual_seed(0)
    hf = Qwen3RMSNorm(64, eps=1e-6).to(dtype)
    ours = RMSNorm(64, 1e-6, dtype, kernels=kernels)
    w = (1 + 0.3 * torch.randn(64)).to(dtype)
    hf.weight.data.copy_(w)
    ours.weight.data.copy_(w)
    x, r = torch.randn(7, 64).to(dtype), torch.randn(7, 64).to(dtype)
    exact = dtype == torch.bfloat16 or not kernels.fused_elementwise

    def same(a, b):
        return torch.equal(a, b) if exact else torch.allclose(a, b, rtol=8 * 2**-23, atol=0)

    with torch.no_grad():
        assert same(ours(x), hf(x))
        out, res = ours(x, r)
        assert torch.equal(res, x + r) and same(out, hf(r + x))


def test_tied_lm_head_shares_embedding():
    emb = VocabEmbedding(50, 8)
    emb.weight.data.normal_()
    head = LMHead(50, 8, tied_to=emb)
    assert head.weight is emb.weight
    logits = head(torch.randn(2, 8))
    assert logits.shape == (2, 50) and logits.dtype == torch.float32


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_block_matches_hf(norm_topk_prob):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(0)
    E, H, I = 8, 32, 16
    cfg = Qwen3MoeConfig(
        hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob
    )
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    ours = SparseMoeBlock(H, I, E, 2, norm_topk_prob, torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    # Feed ours the per-expert checkpoint names, as a saved Qwen3-MoE has them.
    ours.gate.load_weight("weight", hf.gate.weight.data)
    gate_up, down = hf.experts.gate_up_proj.data, hf.experts.down_proj.data
    for e in range(E):
        ours.experts.load_weight(f"{e}.gate_proj.weight", gate_up[e, :I])
        ours.experts.load_weight(f"{e}.up_proj.weight", gate_up[e, I:])
        ours.experts.load_weight(f"{e}.down_proj.weight", down[e])
    x = torch.randn(37, H)
    with torch.no_grad():
        ref = hf(x[None])[0]
    torch.testing.assert_close(ours(x), ref, rtol=1e-5, atol=1e-5)
    assert ours(x[:0]).shape == (0, H)
    # transformers-5 fused names load the same weights.
    fused = SparseMoeBlock(H, I, E, 2, norm_topk_prob, torch.float32)
    fused.gate.load_weight("weight", hf.gate.weight.data)
    assert fused.experts.load_weight("gate_up_proj", gate_up)[1] == fused.experts.expected_shards("w13")
    fused.experts.load_weight("down_proj", down)
    assert torch.equal(fused(x), ours(x))


def test_one_bf16_row_takes_the_gemv_eagerly_and_traced():
    """dense_linear: one bf16 row on CPU goes through a GEMV (the C++ 16-bit GEMV, or torch.mv; row_gemv
    when traced, so inductor does not lower it to a loop of its own), the same values as F.linear within
    bf16 rounding, with a bias too; other shapes and dtypes are F.linear's, bit for bit."""
    from ember.layers.linear import dense_linear

    torch.manual_seed(0)
    w, b = torch.randn(37, 64, dtype=torch.bfloat16), torch.randn(37, dtype=torch.bfloat16)
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    ref = F.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(dense_linear(x, w, b).float(), ref, rtol=0.02, atol=0.05)
    x3 = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(dense_linear(x3, w), F.linear(x3, w))
    assert torch.equal(dense_linear(x.float(), w.float()), F.linear(x.float(), w.float()))
    graphs = []

    def backend(gm, inputs):  # record the traced graph, run it as traced
        graphs.append(str(gm.graph))
        return gm.forward

    traced = torch.compile(dense_linear, backend=backend, fullgraph=True)(x, w, b)
    assert "ember.row_gemv" in graphs[0] and torch.equal(traced, dense_linear(x, w, b))


def test_moe_block_traces_with_no_host_sync():
    """In a traced step (fullgraph: a host sync would break the graph) dense experts run gathered_experts
    and a storage with no gathered form runs the ember::moe_experts op; both give the grouped path's
    values, and two blocks keep their own experts. gathered_experts also runs eagerly (what a CUDA graph
    captures): the same values at batches 1 and 5, and not with the top-k weights swapped."""
    from ember.layers.moe_compute import gathered_experts, grouped_experts

    torch.manual_seed(0)
    E, H, I = 8, 32, 16
    blocks = [SparseMoeBlock(H, I, E, 3, True, torch.float32) for _ in range(3)]
    for block in blocks:
        for p in block.parameters():
            p.data.normal_(0, 0.3)
    blocks[1].experts.gathered = blocks[2].experts.gathered = None  # as AWQ / GGUF experts: the op
    graphs = []

    def backend(gm, inputs):  # record the traced graph, run it as traced
        graphs.append(str(gm.graph))
        return gm.forward

    x = torch.randn(5, H)
    for block in blocks:
        traced = torch.compile(block, backend=backend, fullgraph=True, dynamic=False)(x)
        torch.testing.assert_close(traced, block(x), rtol=1e-5, atol=1e-6)
    assert ["ember.moe_experts" in g for g in graphs] == [False, True, True]
    assert not torch.allclose(blocks[1](x), blocks[2](x))
    ex = blocks[0].experts
    for T in (1, 5):
        weights, ids = blocks[0].route(x[:T])
        ref = grouped_experts(x[:T], ids, weights, E, ex.expert_forward)
        torch.testing.assert_close(ex.gathered(x[:T], ids, weights), ref, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(gathered_experts(x[:T], ids, weights.flip(-1), ex.w13, ex.w2, SiluAndMul()), ref)
