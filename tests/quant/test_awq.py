"""AWQ checkpoints (AutoAWQ GEMM layout) load and run on CPU exactly like their dequantized twins.

Each test quantizes a tiny random HF model with pack_linear, writes it as an AutoAWQ folder
(q_proj.qweight / .qzeros / .scales, quantization_config in config.json or an old
quant_config.json), and writes the same dequantized weights, (q - z) * s in fp32, as a plain
folder. In fp32 the CPU int4 kernel's weights are bit-identical to those (the repack is exact:
(q - 8) * s + (8 - z) * s has one exactly-representable result), so only the summation order
differs: logits must agree to 1e-4 of their scale (the same bound as the HF parity tests;
measured <1e-6) and greedy tokens must be identical.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from ember.errors import ModelLoadError
from ember.layers.linear import DenseMethod, QKVLinear
from ember.loader.model_loader import load_model
from ember.quant.awq import AWQConfig, AWQExperts, AWQLinearMethod, awq_matmul, names_module
from ember.quant.awq_packing import dequantize_awq, pack_linear
from tests.models.tiny_models import PagedDriver, Seq, one_thread, random_prompt

pytestmark = pytest.mark.usefixtures(one_thread.__name__)

QUANTIZED = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")  # what AutoAWQ quantizes (experts too)


def write_awq_pair(
    src: str, root: str, group_size: int, skip=(), legacy: bool = False, quantized: re.Pattern = QUANTIZED
) -> tuple[str, str]:
    """(AWQ folder, dense folder holding its exact dequantized weights) made from the HF folder src;
    quantized: the checkpoint tensors AutoAWQ would pack (default: attention and MLP projections)."""
    awq_dir, dense_dir = os.path.join(root, "awq"), os.path.join(root, "dense")
    awq, dense = {}, {}
    for name, w in load_file(os.path.join(src, "model.safetensors")).items():
        module = name[: -len(".weight")]
        if quantized.search(name) and not any(names_module(e, module) for e in skip):
            G = w.shape[1] if group_size == -1 else group_size
            t = pack_linear(w, G)
            awq.update({f"{module}.{k}": v for k, v in t.items()})
            dense[name] = dequantize_awq(t["qweight"], t["qzeros"], t["scales"].float(), G).t().contiguous()
        else:
            awq[name] = dense[name] = w
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    settings = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(skip) or None,
    }
    for folder, tensors in ((awq_dir, awq), (dense_dir, dense)):
        os.makedirs(folder)
        for f in os.listdir(src):
            if f.startswith("tokenizer"):
                shutil.copy(os.path.join(src, f), folder)
        save_file(tensors, os.path.join(folder, "model.safetensors"))
        cfg = dict(config)
        if folder == awq_dir and legacy:  # older AutoAWQ: settings beside config.json, old key names
            with open(os.path.join(folder, "quant_config.json"), "w") as f:
                json.dump(
                    {
                        "w_bit": 4,
                        "q_group_size": group_size,
                        "zero_point": True,
                        "version": "GEMM",
                        "modules_to_not_convert": list(skip) or None,
                    },
                    f,
                )
        elif folder == awq_dir:
            cfg["quantization_config"] = settings
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(cfg, f)
    return awq_dir, dense_dir


def load(path: str, quantization: str = "auto"):
    return load_model(path, None, torch.float32, torch.device("cpu"), "torch", quantization)


def assert_same_model(awq_model, dense_model, prompt_len: int = 9, new_tokens: int = 12):
    """Prefill + batched-decode logits within 1e-4 of their scale, and identical greedy tokens."""
    for length in (1, prompt_len):  # 1 row (decode-shaped) and a prefill
        ids = random_prompt(length, 100 + length)
        ours = PagedDriver(awq_model).step([(Seq(ids, 0), length)])[0]
        ref = PagedDriver(dense_model).step([(Seq(ids, 0), length)])[0]
        err = (ours - ref).abs().max().item()
        assert err <= 1e-4 * ref.abs().max().item(), f"max |dlogit| {err:.3g} vs max |logit| {ref.abs().max():.3g}"
    seqs = {
        m: [Seq(random_prompt(prompt_len, 7), new_tokens), Seq(random_prompt(5, 8), new_tokens)]
        for m in ("awq", "dense")
    }
    PagedDriver(awq_model).generate(seqs["awq"])
    PagedDriver(dense_model).generate(seqs["dense"])
    assert [s.generated for s in seqs["awq"]] == [s.generated for s in seqs["dense"]]


@pytest.fixture(scope="module")
def qwen3_awq(tiny_model_dir, tmp_path_factory):
    return write_awq_pair(tiny_model_dir("qwen3"), str(tmp_path_factory.mktemp("qwen3-awq")), 32)


@pytest.mark.parametrize("quantization", ["auto", "awq"])
def test_qwen3_awq_runs_as_int4_and_matches_dequantized(qwen3_awq, quantization):
    awq_dir, dense_dir = qwen3_awq
    got, ref = load(awq_dir, quantization), load(dense_dir)
    assert got.quantization == "awq" and ref.quantization == "none"
    attn = got.model.model.layers[0].self_attn
    # One int4 weight for the fused q/k/v, AWQ tensors gone: resident bytes are ~int4.
    assert hasattr(attn.qkv_proj, "int4_packed") and not hasattr(attn.qkv_proj, "qweight")
    assert attn.qkv_proj.int4_packed.shape == (256, 32)  # [N, K/2]: q 128 + k 64 + v 64 rows
    linear_bytes = sum(b.numel() * b.element_size() for n, b in got.model.named_buffers() if "int4" in n)
    dense_linear = sum(p.numel() * 4 for n, p in ref.model.named_parameters() if "_proj" in n)
    assert linear_bytes < dense_linear / 3  # fp32 dense -> 0.5 byte codes + fp32 (s, z) per 32
    assert got.num_parameters == ref.num_parameters
    assert_same_model(got.model, ref.model)


def test_qwen2_bias_and_one_group_per_row(tiny_model_dir, tmp_path):
    """group_size -1 (one group over the whole input) and q/k/v biases that stay dense."""
    awq_dir, dense_dir = write_awq_pair(tiny_model_dir("qwen2"), str(tmp_path), -1)
    got = load(awq_dir)
    qkv = got.model.model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None and hasattr(qkv, "int4_packed")
    assert_same_model(got.model, load(dense_dir).model)


def test_llama_shapes_the_int4_kernel_cannot_take_dequantize_on_the_fly(tiny_model_dir, tmp_path):
    """Llama tiny: qkv N=160, o/down N=96 (not multiples of 64) keep their AWQ tensors."""
    awq_dir, dense_dir = write_awq_pair(tiny_model_dir("llama"), str(tmp_path), 32)
    got = load(awq_dir)
    layer = got.model.model.layers[0]
    assert hasattr(layer.self_attn.qkv_proj, "qweight") and not hasattr(layer.self_attn.qkv_proj, "int4_packed")
    assert hasattr(layer.mlp.gate_up_proj, "int4_packed")  # N=384 does fit
    assert_same_model(got.model, load(dense_dir).model)


def test_legacy_quant_config_json(tiny_model_dir, tmp_path):
    awq_dir, dense_dir = write_awq_pair(tiny_model_dir("qwen3"), str(tmp_path), 64, legacy=True)
    got = load(awq_dir, "awq")
    assert got.quantization == "awq"
    assert_same_model(got.model, load(dense_dir).model, new_tokens=4)


def test_modules_to_not_convert_stay_dense(tiny_model_dir, tmp_path):
    skip = ["model.layers.0.self_attn.o_proj", "layers.1.mlp"]
    awq_dir, dense_dir = write_awq_pair(tiny_model_dir("qwen3"), str(tmp_path), 32, skip=skip)
    got = load(awq_dir)
    l0, l1 = got.model.model.layers
    assert isinstance(l0.self_attn.o_proj.quant_method, DenseMethod)
    assert isinstance(l1.mlp.gate_up_proj.quant_method, DenseMethod)
    assert isinstance(l1.mlp.down_proj.quant_method, DenseMethod)
    assert isinstance(l0.mlp.down_proj.quant_method, AWQLinearMethod)
    assert_same_model(got.model, load(dense_dir).model, new_tokens=4)


def test_qwen3_moe_awq_experts(tiny_model_dir, tmp_path):
    """Per-expert AutoAWQ tensors stack into AWQExperts; the router (mlp.gate) is listed as dense."""
    awq_dir, dense_dir = write_awq_pair(tiny_model_dir("qwen3_moe"), str(tmp_path), 32, skip=["mlp.gate"])
    got = load(awq_dir)
    moe = got.model.model.layers[0].mlp
    assert isinstance(moe.experts, AWQExperts) and moe.experts.int4
    assert isinstance(moe.gate.quant_method, DenseMethod)
    assert moe.experts.w13_packed.shape == (8, 64, 32) and not hasattr(moe.experts, "w13_qweight")
    assert_same_model(got.model, load(dense_dir).model)


def test_moe_experts_dequantize_path_matches_int4_path():
    """The experts' keep-AWQ path (used on CUDA / odd shapes) computes the same as the int4 repack."""
    torch.manual_seed(0)
    E, H, I, G = 4, 64, 32, 32
    experts = [AWQExperts(E, H, I, G, torch.float32) for _ in range(2)]
    for e in range(E):
        for kind, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            t = pack_linear(torch.randn(shape), G)
            for m in experts:
                for k, v in t.items():
                    m.load_weight(f"{e}.{kind}_proj.{k}", v)
    experts[0].repack_for_cpu()
    assert experts[0].int4 and not experts[1].int4
    x = torch.randn(6, H)
    ids = torch.randint(0, E, (6, 2))
    w = torch.rand(6, 2)
    torch.testing.assert_close(experts[0](x, ids, w), experts[1](x, ids, w), rtol=1e-4, atol=1e-4)


def test_cpu_awq_matmul_is_exact_dequantization():
    torch.manual_seed(0)
    t = pack_linear(torch.randn(40, 64), 32)
    x = torch.randn(3, 64)
    ref = x @ dequantize_awq(t["qweight"], t["qzeros"], t["scales"].float(), 32)
    torch.testing.assert_close(awq_matmul(x, t["qweight"], t["qzeros"], t["scales"], 32), ref)
    y16 = awq_matmul(x.half(), t["qweight"], t["qzeros"], t["scales"], 32)  # fp16: AutoAWQ's exact weights
    torch.testing.assert_close(y16, x.half() @ dequantize_awq(t["qweight"], t["qzeros"], t["scales"], 32))


@pytest.mark.engine
def test_llm_generates_same_text_as_dequantized_twin(qwen3_awq):
    from ember import LLM, SamplingParams

    awq_dir, dense_dir = qwen3_awq
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = []
    for path in (awq_dir, dense_dir):
        llm = LLM(model=path, dtype="float32", kv_cache_memory=0.01, max_model_len=128)
        texts.append(
            [o.outputs[0].token_ids for o in llm.generate(["The quick brown fox", "def main():"], sp, use_tqdm=False)]
        )
    assert texts[0] == texts[1]


# ---- settings and shapes --------------------------------------------------------------------------------


def test_from_settings_accepts_both_key_spellings():
    new = AWQConfig.from_settings(
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 64,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ["mlp.gate"],
        }
    )
    old = AWQConfig.from_settings({"w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM"})
    assert (new.group_size, new.modules_to_not_convert) == (64, ["mlp.gate"])
    assert (old.group_size, old.modules_to_not_convert) == (64, [])


def test_modules_to_not_convert_matches_whole_components():
    assert names_module("mlp.gate", "model.layers.3.mlp.gate")
    assert names_module("gate", "model.layers.3.mlp.gate")
    assert not names_module("gate", "model.layers.3.mlp.gate_proj")
    assert names_module("model.layers.3", "model.layers.3.self_attn.q_proj")
    assert not names_module("model.layers.3", "model.layers.31.self_attn.q_proj")
    cfg = AWQConfig(32, ["gate"])
    assert cfg.linear_method("model.layers.0.mlp.gate") is None
    assert isinstance(cfg.linear_method("model.layers.0.mlp.gate_up_proj"), AWQLinearMethod)
    assert AWQConfig(32, ["q_proj", "k_proj", "v_proj"]).linear_method("model.layers.0.self_attn.qkv_proj") is None


def test_partly_skipped_fused_layer_is_refused():
    with pytest.raises(ModelLoadError, match="all quantized or all dense"):
        AWQConfig(32, ["k_proj"]).linear_method("model.layers.0.self_attn.qkv_proj")


def test_group_size_that_does_not_divide_the_input_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="not a multiple of the AWQ group size 128"):
        QKVLinear(64, 32, 4, 2, quant_method=AWQLinearMethod(128))


def test_non_int32_qweight_is_refused():
    layer = QKVLinear(64, 32, 4, 2, quant_method=AWQLinearMethod(32))
    with pytest.raises(ModelLoadError, match="packed int32"):
        layer.load_weight("qweight", torch.zeros(64, 16), "q")
