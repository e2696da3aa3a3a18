"""Dense copy of packed int4 weights (ember.quant.weight_copies): few rows stay on the packed
kernel, many rows run a dense GEMM over an exact dequantization, with the same results."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T
from torch import nn

from ember.errors import ConfigError
from ember.kernels.cpu_kernels import CpuKernels
from ember.layers.linear import QKVLinear
from ember.quant.gemm_dispatch import DENSE_COPY_MIN_ROWS as DENSE_MIN_ROWS
from ember.quant.gemm_dispatch import DenseCopyHeadMethod, DenseCopyMethod
from ember.quant.gguf_quant import GGUFLinearMethod
from ember.quant.weight_copies import enable_dense_copy
from tests.models.tiny_models import PagedDriver, Seq, one_thread  # noqa: F401 (fixture)
from tests.quant.test_awq import assert_same_model, load, write_awq_pair
from tests.quant.test_gguf_packed import _loaded, build, gguf_tensor, tiny_mixed_gguf

pytestmark = pytest.mark.usefixtures("one_thread")
# The bf16 build's tiled parts (Q6_K's included) run their int8-x path at every row count and get no
# copy; with it off they stop at INT4_KERNEL_MAX_ROWS, so a copy serves their many-row steps.
NO_INT8_X = CpuKernels(int8_activations=False)


def test_packed_linear_splits_by_rows():
    layer = QKVLinear(256, 64, 4, 2, bias=True, dtype=torch.bfloat16, quant_method=GGUFLinearMethod(NO_INT8_X))
    tq, rq = gguf_tensor(T.Q4_K, 256, 256, 1)
    tk, rk = gguf_tensor(T.Q4_0, 128, 256, 2)
    tv, rv = gguf_tensor(T.Q6_K, 128, 256, 3)
    _loaded(layer, {"q": tq, "k": tk, "v": tv})
    layer.bias.data.normal_()
    x = torch.randn(3 * DENSE_MIN_ROWS, 256, dtype=torch.bfloat16)
    packed_few, packed_many = layer(x[: DENSE_MIN_ROWS - 1]), layer(x)
    holder = nn.Module()
    holder.layer = layer
    w = torch.cat([rq, rk, rv])  # the GGUF values in float32
    assert enable_dense_copy(holder, torch.bfloat16) == w.numel() * 2
    assert isinstance(layer.quant_method, DenseCopyMethod)
    # The values the kernel computes with: GGUF codes times its bf16-rounded block scales.
    assert (layer.weight_dense.float() - w).abs().max() < 0.01 * w.abs().max()
    assert torch.equal(layer(x[: DENSE_MIN_ROWS - 1]), packed_few)  # few rows: still the packed kernel
    many = layer(x)
    assert torch.equal(many, F.linear(x, layer.weight_dense, layer.bias))  # many rows: the dense copy
    assert (many.float() - packed_many.float()).abs().max() < 0.02 * packed_many.float().abs().max()


def test_float32_tiled_layers_get_no_copy():
    """Where the tiled GEMV's AVX2 build takes float32 (int16 x, ahead of the float32 GEMM at every
    row count), layers of tiled parts (a Q6_K shard's tiles among them) get no copy and run the kernel
    for every step; elsewhere the copy takes over from DENSE_MIN_ROWS."""
    from ember.kernels import cpu_tiled_gemv
    from ember.layers.linear import MergedColumnLinear
    from ember.quant.gguf_quant import TiledPart

    layer = MergedColumnLinear(256, [192, 192], quant_method=GGUFLinearMethod())
    _loaded(layer, {"gate": gguf_tensor(T.Q4_0, 192, 256, 4)[0], "up": gguf_tensor(T.Q4_1, 192, 256, 5)[0]})
    mixed = QKVLinear(256, 64, 4, 2, quant_method=GGUFLinearMethod())
    _loaded(
        mixed,
        {
            "q": gguf_tensor(T.Q4_0, 256, 256, 1)[0],
            "k": gguf_tensor(T.Q4_0, 128, 256, 2)[0],
            "v": gguf_tensor(T.Q6_K, 128, 256, 3)[0],
        },
    )
    holder = nn.Module()
    holder.layer, holder.mixed = layer, mixed
    tiled = all(isinstance(p, TiledPart) for p in layer.gguf_parts) and cpu_tiled_gemv.rounds_x()
    x = torch.randn(300, 256)
    kernel = [layer(x[:n]) for n in (DENSE_MIN_ROWS, 300)]
    added = enable_dense_copy(holder, torch.float32)
    assert added == (0 if tiled else (512 + 384) * 256 * 4)  # q, k, v: 512 rows; gate, up: 384
    assert isinstance(mixed.quant_method, DenseCopyMethod) != tiled  # the Q6_K shard: its tiles where tiled
    assert isinstance(layer.quant_method, DenseCopyMethod) != tiled
    for n, before in zip((DENSE_MIN_ROWS, 300), kernel):
        assert torch.equal(layer(x[:n]), before if tiled else F.linear(x[:n], layer.weight_dense)), n
    if tiled:  # the kernel's many-row path, against the exact weights within its rounding of x
        w = torch.cat([p.dequantize() for p in layer.gguf_parts])
        exact = x.double() @ w.double().t()
        err = (kernel[1].double() - exact).abs()
        assert (err <= cpu_tiled_gemv.rounding_bound(x, w) + 1e-5 * exact.abs() + 1e-6).all()


def test_already_dense_layers_get_no_copy():
    from ember.layers.linear import MergedColumnLinear

    layer = MergedColumnLinear(256, [192, 192], quant_method=GGUFLinearMethod())
    _loaded(layer, {"gate": gguf_tensor(T.F16, 192, 256, 4)[0], "up": gguf_tensor(T.BF16, 192, 256, 5)[0]})
    holder = nn.Module()
    holder.layer = layer
    assert enable_dense_copy(holder, torch.bfloat16) == 0
    assert isinstance(layer.quant_method, GGUFLinearMethod)


def test_tiny_gguf_model_with_copy_matches_without(tmp_path):
    """A whole packed model (untied Q6_K head): logits of a 12-token prefill and greedy tokens of a
    batch agree with the packed-only model; the embedding keeps its packed lookups."""
    path = tiny_mixed_gguf(tmp_path / "m.gguf", "qwen2", tied=False)
    plain, copied = build(path, True, torch.bfloat16, NO_INT8_X), build(path, True, torch.bfloat16, NO_INT8_X)
    extra = enable_dense_copy(copied, torch.bfloat16)
    assert isinstance(copied.lm_head.quant_method, DenseCopyHeadMethod)
    assert extra > copied.lm_head.vocab_size * 256 * 2
    ids = torch.tensor([3, 17, 99, 150, 42, 8, 0, 77, 5, 6, 7, 8])
    assert torch.equal(copied.model.embed_tokens(ids), plain.model.embed_tokens(ids))
    h = torch.randn(DENSE_MIN_ROWS + 3, 256, dtype=torch.bfloat16)
    a, b = copied.compute_logits(h), plain.compute_logits(h)
    assert torch.equal(a.argmax(-1), b.argmax(-1)) and (a - b).abs().max() < 0.02 * b.abs().max()
    outs = []
    for model in (plain, copied):
        seqs = [Seq(prompt=ids.tolist(), max_new=6), Seq(prompt=[5, 6], max_new=6)]
        PagedDriver(model).generate(seqs)
        outs.append([s.generated for s in seqs])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("flag", [None, True])
def test_the_engines_default_copy_leaves_the_lm_head_packed(tmp_path, flag):
    """--int4-dense-copy auto copies the layers a many-row step runs on a dense GEMM, but not the LM head
    (its rows are the sampled sequences; a 248K-vocab tied head's copy was 485 MiB beside 303 MiB packed,
    and 970 MiB more while it was dequantized to float32): only an explicit --int4-dense-copy copies it."""
    from types import SimpleNamespace

    from ember.engine.startup.weights import dense_copy

    model = build(tiny_mixed_gguf(tmp_path / "m.gguf", "qwen2", tied=False), True, torch.bfloat16, NO_INT8_X)
    head_part = model.lm_head.quant_method.part
    config = SimpleNamespace(kernel_config=SimpleNamespace(int4_dense_copy=flag))
    setup = SimpleNamespace(device=torch.device("cpu"), dtype=torch.bfloat16, kernels=NO_INT8_X)
    extra = dense_copy(config, setup, SimpleNamespace(model=model), False)
    head_bytes = model.lm_head.vocab_size * 256 * 2
    assert isinstance(model.model.layers[0].mlp.down_proj.quant_method, DenseCopyMethod)  # a Q6_K layer
    if flag is None:
        assert not isinstance(model.lm_head.quant_method, DenseCopyHeadMethod) and 0 < extra
        assert not any(name.endswith("weight_dense") for name, _ in model.lm_head.named_buffers())
    else:
        assert isinstance(model.lm_head.quant_method, DenseCopyHeadMethod) and extra > head_bytes
        assert torch.equal(model.lm_head.weight_dense, head_part.dequantize().bfloat16())


def test_head_copy_is_built_in_row_chunks(monkeypatch, tmp_path):
    from ember.quant import gguf_quant

    model = build(tiny_mixed_gguf(tmp_path / "m.gguf", "qwen2", tied=False), True, torch.bfloat16)
    method = model.lm_head.quant_method
    monkeypatch.setattr(gguf_quant, "PACK_CHUNK_ROWS", 64)  # 160 rows: chunks of 64, 64 and 32
    assert torch.equal(method.dense_weight(torch.bfloat16), method.part.dequantize().bfloat16())


def test_awq_model_with_copy_matches_dequantized(tiny_model_dir, tmp_path):
    awq_dir, dense_dir = write_awq_pair(tiny_model_dir("qwen3"), str(tmp_path), 32)
    got, ref = load(awq_dir), load(dense_dir)
    assert enable_dense_copy(got.model, torch.float32) > 0
    assert isinstance(got.model.model.layers[0].self_attn.qkv_proj.quant_method, DenseCopyMethod)
    assert_same_model(got.model, ref.model, prompt_len=DENSE_MIN_ROWS + 2)  # the prefill runs on the copy


@pytest.mark.engine
def test_default_model_copy_is_on_in_bf16_and_flags_are_checked():
    from ember import LLM, SamplingParams
    from ember.kernels import cpu_tiled_gemv as tg

    # bf16 with the int8-activation path (AVX-512 VNNI): every step on the packed weights, no copy
    llm = LLM(kv_cache_memory=0.05, max_model_len=512, dtype="bfloat16", enable_mtp=False)
    assert (llm.engine.parts.copies.dense_copy_bytes == 0) == tg.has_q8()
    prompts = ["The capital of France is", "List three colors: red, green, and the third one"]
    sp = SamplingParams(temperature=0, max_tokens=8)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert "Paris" in llm.tokenizer.decode(first[0])
    # bf16 activations: the copy serves steps of DENSE_MIN_ROWS rows and more
    copy = LLM(kv_cache_memory=0.05, max_model_len=512, dtype="bfloat16", enable_mtp=False, cpu_int8_activations=False)
    assert copy.engine.parts.copies.dense_copy_bytes > 200e6  # ~269 MB of bf16 beside 102 MB packed
    with_copy = [o.outputs[0].token_ids for o in copy.generate(prompts, sp, use_tqdm=False)]
    off = LLM(
        kv_cache_memory=0.05,
        max_model_len=512,
        dtype="bfloat16",
        enable_mtp=False,
        int4_dense_copy=False,
        cpu_int8_activations=False,
    )
    assert off.engine.parts.copies.dense_copy_bytes == 0
    without = [o.outputs[0].token_ids for o in off.generate(prompts, sp, use_tqdm=False)]
    # three kernels (a dense GEMM, the packed one, int8 x) round differently, so only a clear answer must
    # agree (the second prompt meets a near-tie at its third token on Zen3's int4 kernel)
    assert without[0] == with_copy[0] == first[0] and len(without[1]) == 8
    if tg.has_q8():
        with pytest.raises(ConfigError, match="no-cpu-int8-activations"):
            LLM(kv_cache_memory=0.05, max_model_len=512, dtype="bfloat16", enable_mtp=False, int4_dense_copy=True)
    from ember.quant.gguf_quant import TiledPart

    # float32: packed only where the tiled GEMV takes float32 (AVX2 build), and then on the kernel at
    # every row count, so no copy either way; asking for one there says why not
    fp32 = LLM(kv_cache_memory=0.05, max_model_len=512, dtype="float32", enable_mtp=False)
    assert fp32.engine.parts.copies.dense_copy_bytes == 0
    gate_up = fp32.engine.parts.runner.model.model.layers[0].mlp.gate_up_proj
    parts = getattr(gate_up, "gguf_parts", [])  # none: dequantized
    tiled = bool(parts) and all(isinstance(p, TiledPart) for p in parts)
    assert tiled == (tg.x_dtype() == torch.float32)
    if tg.x_dtype() == torch.float32:
        with pytest.raises(ConfigError, match="beats a float32 dense GEMM"):
            LLM(kv_cache_memory=0.05, max_model_len=512, dtype="float32", enable_mtp=False, int4_dense_copy=True)
    with pytest.raises(ConfigError, match="int4-dense-copy needs packed"):
        LLM(kv_cache_memory=0.05, max_model_len=512, quantization="none", int4_dense_copy=True)


def test_q6_k_tiles_need_no_copy():
    """bf16 on AVX-512 BF16 + VNNI: a Q4_K_M-like qkv (Q4_K, Q4_0 and a Q6_K v) is all tiled parts that
    run the int8-x path at every row count, so --int4-dense-copy adds nothing for it."""
    from ember.kernels import cpu_tiled_gemv
    from ember.quant.gguf_quant import TiledQ6KPart

    if not (cpu_tiled_gemv.has_q6k() and cpu_tiled_gemv.has_q8() and cpu_tiled_gemv.available()):
        pytest.skip("the Q6_K tiles' int8-x path needs AVX-512 BF16, VNNI and VBMI")
    layer = QKVLinear(256, 64, 4, 2, dtype=torch.bfloat16, quant_method=GGUFLinearMethod())
    _loaded(
        layer,
        {
            "q": gguf_tensor(T.Q4_K, 256, 256, 1)[0],
            "k": gguf_tensor(T.Q4_0, 128, 256, 2)[0],
            "v": gguf_tensor(T.Q6_K, 128, 256, 3)[0],
        },
    )
    assert isinstance(layer.gguf_parts[-1], TiledQ6KPart)
    holder = nn.Module()
    holder.layer = layer
    assert enable_dense_copy(holder, torch.bfloat16) == 0 and isinstance(layer.quant_method, GGUFLinearMethod)
