"""Int8 decode weights: close to the dense weights, used only for decode-sized batches."""

import pytest
import torch

from ember.errors import ConfigError
from ember.layers.linear import ReplicatedLinear
from ember.quant.gemm_dispatch import Int8DecodeMethod, quantize_rows_int8
from ember.quant.weight_copies import enable_int8_decode
from tests.models.tiny_models import load_ember_model


def test_row_quantization_error_is_within_half_a_step():
    w = torch.randn(64, 96) * torch.linspace(0.01, 3, 64)[:, None]
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()


def test_linear_picks_int8_for_few_rows_and_dense_for_many():
    torch.manual_seed(0)
    lin = ReplicatedLinear(64, 48, bias=True, dtype=torch.bfloat16)
    lin.weight.data.normal_(0, 0.1)
    lin.bias.data.normal_(0, 0.1)
    x = torch.randn(40, 64, dtype=torch.bfloat16)
    dense = lin(x)
    lin.quant_method = Int8DecodeMethod()
    lin.quant_method.process_weights_after_loading(lin)
    few = lin(x[:4])
    assert not torch.equal(few, dense[:4])  # really the int8 kernel
    torch.testing.assert_close(few.float(), dense[:4].float(), rtol=0.05, atol=0.03)
    assert torch.equal(lin(x), dense)  # many rows: the dense weight, bit for bit


def test_model_logits_close_and_same_argmax(tiny_model_dir):
    model = load_ember_model(tiny_model_dir("llama"), dtype=torch.bfloat16)
    ref_model = load_ember_model(tiny_model_dir("llama"), dtype=torch.bfloat16)
    enable_int8_decode(model)
    h = torch.randn(3, model.cfg.hidden_size, dtype=torch.bfloat16)
    a, b = model.compute_logits(h), ref_model.compute_logits(h)
    assert torch.equal(a.argmax(-1), b.argmax(-1))
    assert (a - b).abs().max() < 0.02 * b.abs().max()


@pytest.mark.engine
def test_dequantized_default_model_uses_it_in_bf16_and_refuses_fp32():
    from ember import LLM, SamplingParams

    llm = LLM(kv_cache_memory=0.05, max_model_len=512, dtype="bfloat16", quantization="none")
    assert llm.engine.parts.copies.int8_decode_bytes > 100e6
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    with pytest.raises(ConfigError, match="int8-decode"):
        LLM(kv_cache_memory=0.05, max_model_len=512, dtype="float32", int8_decode=True, quantization="none")
