"""A bf16 GGUF file (written by llama.cpp's converter) in a float32 run keeps its matrices 16-bit
(gguf_quant.HalfPart over ember/kernels/cpu_half_gemv): every projection, the embedding and the LM head
hold the file's bits, `ember plan` counts them at 2 bytes, and the run gives the greedy tokens and
logprobs of the same file widened to float32 at load (--no-cpu-half-weights), chunked and batched."""

from __future__ import annotations

import os

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.peers.llamacpp_convert import convert, write_qwen_tokenizer
from ember.kernels import cpu_half_gemv
from tests.models.tiny_hybrids import build_hybrid
from tests.models.tiny_models import one_thread  # noqa: F401

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.engine,
    pytest.mark.skipif(not cpu_half_gemv.available(), reason="needs AVX2 + FMA + F16C and a C++ compiler"),
]
VOCAB = 151936  # Qwen's tokenizer (the converter takes only tokenizers it knows)


@pytest.fixture(scope="module")
def bf16_file(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gguf-half"))
    model = build_hybrid("qwen3_5", vocab_size=VOCAB)
    path = os.path.join(root, "qwen3_5")
    model.save_pretrained(path)
    write_qwen_tokenizer(path)
    return convert(path, path + ".bf16.gguf", "bf16", ("--no-mtp",))


def llm(path, **kw):
    args = dict(dtype="float32", kv_cache_memory=0.02, max_model_len=128, num_threads=1)
    return LLM(path, **(args | {"max_num_batched_tokens": 7, "max_num_seqs": 4} | kw))


def parts(model) -> list:
    """Every packed part of the model's GGUF linears, embedding and head."""
    out = []
    for m in model.modules():
        out += getattr(m, "gguf_parts", [])
        method = getattr(m, "quant_method", None)
        if getattr(method, "part", None) is not None:
            out.append(method.part)
    return out


def test_bf16_file_stays_16_bit_and_agrees_with_its_float32_widening(bf16_file):
    from ember.quant.gguf_quant import DensePart, HalfPart

    half, wide = llm(bf16_file), llm(bf16_file, cpu_half_weights=False)
    held = parts(half.engine.parts.runner.model)
    assert held and all(isinstance(p, HalfPart) and p.w.dtype == torch.bfloat16 for p in held)
    assert all(isinstance(p, DensePart) and p.w.dtype == torch.float32 for p in parts(wide.engine.parts.runner.model))
    assert_same_answers(half, wide, [[(t * 37) % 150000 for t in range(1, n)] for n in (5, 20, 33)])


def assert_same_answers(a_llm, b_llm, prompts: list[list[int]], tol: float = 1e-4) -> None:
    """Both engines give the same 12 greedy tokens and first-token top-5 logprobs within tol (float32 sums
    in another order) for every prompt, batched."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in prompts]
    for a, b in zip(*(m.generate(prompts, params, use_tqdm=False) for m in (a_llm, b_llm))):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert la.keys() == lb.keys()
        assert max(abs(la[t].logprob - lb[t].logprob) for t in lb) < tol


def test_plan_counts_the_matrices_at_two_bytes(bf16_file):
    """peak_rss's held bytes of the file's tensors in a float32 run: 2 B a matrix weight with the flag, 4 without."""
    from ember.engine.peak_rss import GGUFTensorInfo, gguf_weight_bytes
    from ember.loader.gguf import GGUFCheckpoint

    tensors = [GGUFTensorInfo(*t) for t in GGUFCheckpoint(bf16_file).loaded_tensor_infos()]
    matrices = sum(t.elements for t in tensors if t.dims >= 2 and t.type_name == "BF16")
    assert matrices  # the converter keeps a few small matrices (the conv) in F32: 4 B either way
    kept, widened = gguf_weight_bytes(tensors, 4, True), gguf_weight_bytes(tensors, 4, True, half_weights=False)
    assert widened - kept == 2 * matrices
