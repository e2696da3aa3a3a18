"""Round-to-nearest int4 repacking of dense Linears / an own LM head (the MTP draft layers on CPU)."""

from __future__ import annotations

import torch

from ember.layers.embedding import LMHead
from ember.layers.linear import DenseMethod, ReplicatedLinear
from ember.quant.rtn_int4 import RTNInt4Head, RTNInt4Method, pack_module_int4, rtn_affine, to_int4


def test_rtn_codes_reconstruct_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(128, 96) * 0.05
    q, scale, offset = rtn_affine(w, 32)
    assert q.min() >= 0 and q.max() <= 15
    back = (q.float().view(128, 3, 32) * scale[..., None] + offset[..., None]).view(128, 96)
    assert ((back - w).abs().view(128, 3, 32) <= scale[..., None] / 2 + 1e-7).all()
    # the kernel container holds the same affine values: exactly in fp32, within half a step (+ bf16
    # rounding of w, scale and offset) in bf16
    assert torch.equal(to_int4(w, 32).dequantize(torch.float32), back)
    deq = to_int4(w.bfloat16(), 32).dequantize(torch.float32)
    assert ((deq - w).abs().view(128, 3, 32) <= scale[..., None] * 0.55 + 2e-3).all()


class Tiny(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = ReplicatedLinear(64, 128, bias=True, dtype=dtype)
        self.odd = ReplicatedLinear(64, 40, dtype=dtype)  # 40 rows: not a multiple of 64, stays dense
        self.head = LMHead(192, 128, dtype=dtype)
        for p in self.parameters():
            torch.nn.init.normal_(p, std=0.05)


def test_pack_module_replaces_dense_weights_and_matches_the_dequantized_math():
    torch.manual_seed(1)
    m = Tiny(torch.bfloat16)
    w_proj, w_head = m.proj.weight.data.clone(), m.head.weight.data.clone()
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    dense_h = m.proj(x)
    saved = pack_module_int4(m)
    assert saved > 0 and not hasattr(m.proj, "weight") and isinstance(m.proj.quant_method, RTNInt4Method)
    assert isinstance(m.odd.quant_method, DenseMethod)
    assert isinstance(m.head.quant_method, RTNInt4Head)
    h = m.proj(x)
    ref = x.float() @ to_int4(w_proj, 32).dequantize(torch.float32).t() + m.proj.bias.float()
    assert torch.allclose(h.float(), ref, atol=3e-2, rtol=2e-2)
    assert (h.float() - dense_h.float()).abs().max() < 0.1 * dense_h.float().abs().max()
    logits = m.head(h)
    assert logits.dtype == torch.float32 and logits.shape == (3, 192)
    ref_logits = h.float() @ to_int4(w_head, 32).dequantize(torch.float32).t()
    assert torch.allclose(logits, ref_logits, atol=3e-2, rtol=2e-2)


def test_float32_modules_are_left_alone():
    m = Tiny(torch.float32)
    assert pack_module_int4(m) == 0 and isinstance(m.proj.quant_method, DenseMethod) and m.head.quant_method is None
