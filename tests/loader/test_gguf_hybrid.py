"""GGUF files of hybrid Qwen models written by llama.cpp's own converter (convert_hf_to_gguf.py from
the llama-cpp-python sdist, ember.bench.peers.llamacpp_convert) from tiny random HF folders: ember gives
transformers' greedy tokens on the folder (chunked, batched), keeps q8_0 matrices packed, matches
llama.cpp's own logits on the file, and names what a broken file lacks."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.peers.llamacpp_convert import convert, write_qwen_tokenizer
from ember.errors import ModelLoadError
from tests.models.tiny_hybrids import build_hybrid
from tests.models.tiny_models import hf_greedy, one_thread  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
VOCAB = 151936  # Qwen's tokenizer (the converter takes only tokenizers it knows)
# llama.cpp's converter has no dense layers for Qwen3-Next (mlp_only_layers): every layer sparse here
OVERRIDES = {"qwen3_next": {"mlp_only_layers": []}, "qwen3_5": {}, "qwen3_5_moe": {}}
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def prompts():
    return [[(t * 37) % 150000 for t in range(1, n)] for n in (5, 20, 33)]


def hf_folder(root, arch, **extra):
    model = build_hybrid(arch, vocab_size=VOCAB, **OVERRIDES[arch], **extra)
    path = os.path.join(root, arch)
    model.save_pretrained(path)
    write_qwen_tokenizer(path)
    return model, path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gguf-hybrid"))
    out = {}
    for arch in OVERRIDES:
        model, path = hf_folder(root, arch)
        out[arch] = (model, convert(path, path + ".f32.gguf", "f32", ("--no-mtp",)))
    return out


def llm(path, **kw):
    return LLM(
        path,
        **(
            {
                "dtype": "float32",
                "kv_cache_memory": 0.02,
                "max_model_len": 128,
                "num_threads": 1,
                "max_num_batched_tokens": 7,
                "max_num_seqs": 4,
            }
            | kw
        ),
    )


@pytest.mark.parametrize("arch", list(OVERRIDES))
def test_converted_file_gives_transformers_greedy_tokens(converted, arch):
    hf, gguf = converted[arch]
    outs = llm(gguf).generate([{"prompt_token_ids": p} for p in prompts()], GREEDY, use_tqdm=False)
    for p, o in zip(prompts(), outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 16), (arch, len(p))


def test_q8_0_matrices_stay_packed_and_agree_with_their_dequantized_values(tmp_path):
    """hidden 64: q8_0's 32-wide blocks fit, so the projections are stored quantized. Packed (in the dtype
    the tiled GEMV takes: bf16 on AVX-512 BF16, float32 on AVX2; no dense copy beside them) against the
    same file dequantized to float32: the same top-5 first tokens, logprobs within bf16 noise (a row in the
    wrong place -- a value-head reorder, a q/k/v split -- would scramble them)."""
    from ember.kernels import cpu_tiled_gemv

    _, path = hf_folder(str(tmp_path), "qwen3_5", hidden_size=64)
    q8 = convert(path, path + ".q8.gguf", "q8_0", ("--no-mtp",))
    packed_dtype = "float32" if cpu_tiled_gemv.x_dtype() == torch.float32 else "bfloat16"
    packed, dense = llm(q8, dtype=packed_dtype), llm(q8, dtype="float32", quantization="none")
    layer = next(layer for layer in packed.engine.parts.runner.model.model.layers if layer.is_linear)
    assert type(layer.linear_attn.in_proj_qkvz.quant_method).__name__ == "GGUFLinearMethod"
    dense_layer = dense.engine.parts.runner.model.model.layers[0]
    assert type(dense_layer.linear_attn.in_proj_qkvz.quant_method).__name__ == "DenseMethod"
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for a, b in zip(
        *(m.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False) for m in (packed, dense))
    ):
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert la.keys() == lb.keys()
        assert max(abs(la[t].logprob - lb[t].logprob) for t in lb) < 1.0


def test_quantized_ssm_out_stays_packed_and_reads_its_input_in_the_files_order(tmp_path):
    """Qwen3.5 with more value heads than key heads: the converter tiles ssm_out's columns (value heads),
    which cannot move inside quantized blocks. out_proj keeps the file's q8_0 blocks and permutes its
    input instead (once it was dequantized): packed and dequantized float32 runs give the same logits."""
    from ember.quant.gguf_quant import InputOrderPart

    _, path = hf_folder(str(tmp_path), "qwen3_5", hidden_size=64, linear_key_head_dim=16, linear_value_head_dim=16)
    q8 = convert(path, path + ".q8.gguf", "q8_0", ("--no-mtp",))
    packed, dense = llm(q8, quantization="gguf"), llm(q8)  # float32: packed only when forced
    layers = [layer for layer in packed.engine.parts.runner.model.model.layers if layer.is_linear]
    for layer in layers:
        (part,) = layer.linear_attn.out_proj.gguf_parts
        assert isinstance(part, InputOrderPart) and type(part.inner).__name__ != "DensePart"
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=20, ignore_eos=True)
    for a, b in zip(
        *(m.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False) for m in (packed, dense))
    ):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t].logprob - lb[t].logprob) for t in lb) < 1e-3


def test_logits_match_llama_cpp_on_the_file(tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")  # the bench extra (compiles llama.cpp): pip install -e '.[bench]'
    # llama.cpp's qwen35 takes value heads as wide as key heads (dk == dv)
    hf, path = hf_folder(str(tmp_path), "qwen3_5", linear_key_head_dim=16, linear_value_head_dim=16)
    gguf = convert(path, path + ".f32.gguf", "f32", ("--no-mtp",))
    ids = prompts()[2]
    peer = llama_cpp.Llama(gguf, logits_all=True, n_threads=1, n_ctx=128, verbose=False)
    peer.eval(ids)
    theirs = torch.tensor(peer.scores[len(ids) - 1])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    ours = (
        llm(gguf)
        .generate(
            [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=1, logprobs=20), use_tqdm=False
        )[0]
        .outputs[0]
    )
    top = sorted(ours.logprobs[0], key=lambda t: -ours.logprobs[0][t].logprob)
    assert top[0] == int(theirs.argmax()) == int(ref.argmax())
    theirs_lp = torch.log_softmax(theirs.double(), -1)
    # ember's log-probabilities of its top 20 are llama.cpp's own, to llama.cpp's fp32 accumulation noise
    assert max(abs(ours.logprobs[0][t].logprob - float(theirs_lp[t])) for t in top) < 1e-2
    assert (theirs - ref).abs().max() / ref.abs().max() < 1e-2  # and llama.cpp's agree with transformers


def test_q4_k_m_file_from_llama_cpps_quantizer_agrees_with_llama_cpp(tmp_path):
    """A Q4_K_M file written by llama.cpp's own quantizer (hidden 256, so its K-quants apply: Q6_K in the
    tied embedding / head, attn_qkv, attn_v and ffn_down, Q4_K elsewhere). A run in the tiled GEMV's dtype
    (bf16 on AVX-512 BF16, float32 on AVX2) keeps Q6_K in its Q6_K tiles (no dense copy where its kernel
    serves every row count: the int8-x path, the AVX2 build), and both runs give llama.cpp's greedy token. llama.cpp multiplies K-quants by activations rounded to int8 per
    256 (Q8_K), which on this random model moves its top-5 logprobs by up to ~1.6 from ember's exact
    float32 run (measured), so the logprobs are held to a band: the bf16 run no further from llama.cpp's
    than the float32 run, plus 0.5 (measured: 0.70 / 1.26 / 0.85 against 0.76 / 1.57 / 1.01)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from ember.bench.peers.llamacpp_convert import quantize
    from ember.kernels import cpu_tiled_gemv
    from ember.quant.gguf_quant import TiledQ6KPart

    model = build_hybrid(
        "qwen3_5",
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
    )
    with torch.no_grad():  # the fixtures' 0.15 is sized for hidden 48; at 256 the random net turns chaotic
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed" not in name:
                p.mul_(0.35)
    path = os.path.join(str(tmp_path), "qwen3_5")
    model.save_pretrained(path)
    write_qwen_tokenizer(path)
    f32 = convert(path, path + ".f32.gguf", "f32", ("--no-mtp",))
    q4km = quantize(f32, path + ".q4_k_m.gguf", "Q4_K_M", threads=1)
    peer = llama_cpp.Llama(q4km, logits_all=True, n_threads=1, n_ctx=128, verbose=False)
    theirs = []
    for ids in prompts():
        peer.reset()
        peer.eval(ids)
        theirs.append(torch.log_softmax(torch.tensor(peer.scores[len(ids) - 1]).double(), -1))
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    far = {}
    for dtype in ("float32", "bfloat16"):
        engine = llm(q4km, dtype=dtype)
        if cpu_tiled_gemv.has_q6k() and getattr(torch, dtype) == cpu_tiled_gemv.x_dtype():
            runner_model = engine.engine.parts.runner.model
            parts = [p for m in runner_model.modules() for p in getattr(m, "gguf_parts", [])]
            q6k = [p for p in parts if isinstance(p, TiledQ6KPart)]
            assert len(q6k) >= 4 and isinstance(runner_model.lm_head.quant_method.part, TiledQ6KPart)
            any_rows = cpu_tiled_gemv.has_q8() or dtype == "float32"  # the int8-x path, or the AVX2 build
            assert all(p.kernel_at_any_rows == any_rows for p in q6k)
            assert engine.engine.parts.copies.dense_copy_bytes == 0 or not any_rows
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts()], params, use_tqdm=False)
        far[dtype] = []
        for out, th in zip(outs, theirs):
            assert out.outputs[0].token_ids[0] == int(th.argmax()), dtype
            lp, top = out.outputs[0].logprobs[0], th.topk(5).indices.tolist()
            far[dtype].append(max(abs(lp[t].logprob - float(th[t])) for t in top))
    assert max(far["bfloat16"]) <= max(far["float32"]) + 0.5, far


def test_a_file_missing_a_tensor_is_named(tmp_path):
    _, path = hf_folder(str(tmp_path), "qwen3_5")
    from safetensors.torch import load_file, save_file

    tensors = load_file(os.path.join(path, "model.safetensors"))
    del tensors["model.layers.0.linear_attn.in_proj_b.weight"]
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    gguf = convert(path, path + ".gguf", "f32", ("--no-mtp",))
    with pytest.raises(ModelLoadError, match=r"layers\.0\.linear_attn\.in_proj_ba\.weight \(shards \['b'\]\)"):
        llm(gguf)
    shutil.rmtree(path)
