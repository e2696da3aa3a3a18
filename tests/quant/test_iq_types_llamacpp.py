"""A file quantized by llama.cpp's own quantizer (llama_model_quantize) to the grid-coded IQ types (IQ3_XXS, IQ3_S,
IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M; kernels: ember/kernels/cpu_block_gemv_iq.cpp): ember's top-20 prompt
logprobs agree with llama.cpp's on the same file, and no matrix of those types is dequantized at load.

One file holds all seven types, each in an attention matrix (the dense BlockPart path) and in an expert tensor
(block_moe): LAYOUT, llama-quantize's per-tensor overrides. One file rather than one a type because llama.cpp's
quantizer builds each type's search tables first (measured on 2 busy cores: IQ1_S 13 s of CPU, IQ2_S 6 s,
IQ2_XS 3 s, IQ2_XXS 2 s), so the file is quantized once a machine and kept (cached_quantize). llama.cpp
refuses these types without an importance matrix; the file is quantized with a uniform one (all ones: every
column weighs alike, plain squared error; llamacpp_convert.uniform_imatrix_sizes), which changes which codes
the quantizer picks, not the format the kernels read.

The model: the tiny random Qwen3-MoE of tests/quant/test_block_types_llamacpp.py (hidden 256, so every matrix
takes 256-element types; 3 layers, 4 experts of 256, top-2; a 300-token SentencePiece vocabulary), written as float32
by gguf-py's writer."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from ember import LLM, SamplingParams
from ember.kernels import cpu_block_gemv
from ember.quant import gguf_blocks
from ember.quant.gguf_block_part import BLOCK_TYPES, BlockPart
from tests.loader.test_gguf import tiny_model, write_gguf
from tests.models.tiny_models import one_thread  # noqa: F401 (fixture)
from tests.quant.test_block_types_llamacpp import llama_logprobs, spm_vocab

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.engine,
    pytest.mark.skipif(not cpu_block_gemv.available(), reason="needs a C++ compiler"),
]
llama_cpp = pytest.importorskip("llama_cpp")  # the bench extra: pip install -e '.[bench]'

IQ_TYPES = ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"]
SLOTS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"]
# each layer's SLOTS -> types: every IQ type in some attention matrix and in some expert tensor
LAYOUT = [
    ["IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M"],
    ["IQ2_S", "IQ1_S", "IQ1_M", "IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS"],
    ["IQ1_M", "IQ2_S", "IQ3_S", "IQ2_XXS", "IQ3_XXS", "IQ2_XS", "IQ1_S"],
]
OVERRIDES = {rf"^blk\.{i}\.{slot}\.weight$": t for i, types in enumerate(LAYOUT) for slot, t in zip(SLOTS, types)}
# max |ember - llama.cpp| over ember's top 20 at every position of a 24-token prompt; both round x to Q8K the
# same way, so the gap is the two engines' float32 summation orders
TOLERANCE = 2e-2
EXPERTS, TOP_K, LENGTH = 4, 2, 24


def cached_quantize(f32: str, **options) -> str:
    """llamacpp_convert.quantize(f32, ..., **options) once a machine: the result is kept under ~/.cache/ember,
    named by a hash of the input file, the options and llama-cpp-python's version."""
    from ember.bench.peers.llamacpp_convert import quantize

    key = hashlib.sha1(open(f32, "rb").read())
    key.update(json.dumps(options, sort_keys=True).encode() + llama_cpp.__version__.encode())
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ember", "test-gguf")
    os.makedirs(cache, exist_ok=True)
    path = os.path.join(cache, f"iq-types-{key.hexdigest()[:16]}.gguf")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        quantize(f32, tmp, **options)
        os.replace(tmp, path)  # whole or not at all: another process sees no file or this one
    return path


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    vocab = spm_vocab(41)
    moe = {"qwen3moe.expert_count": EXPERTS, "qwen3moe.expert_used_count": TOP_K}
    moe["qwen3moe.expert_feed_forward_length"] = 256
    meta, tensors = tiny_model(
        "qwen3moe", layers=len(LAYOUT), hidden=256, heads=4, kv_heads=2, head_dim=64,
        vocab=len(vocab["tokenizer.ggml.tokens"]), experts=EXPERTS, moe_ffn=256, extra_meta=moe | vocab,
    )  # fmt: skip
    for name, w in tensors.items():  # a unit-variance random net is chaotic at hidden 256: scale it down
        if w.ndim >= 2 and name != "token_embd.weight":
            w *= 0.6 / np.sqrt(w.shape[-1])
        elif w.ndim == 1:
            tensors[name] = 1 + 0.1 * w
    f32 = str(write_gguf(tmp_path_factory.mktemp("iq-types") / "moe.f32.gguf", "qwen3moe", meta, tensors))
    return cached_quantize(f32, ftype="Q8_0", threads=1, overrides=OVERRIDES, uniform_imatrix=True)


def kept_block_types(engine) -> tuple[set, set]:
    """The ggml types the loaded model keeps as the file's blocks: (linear parts, experts)."""
    model = engine.engine.parts.runner.model
    parts = [p for m in model.modules() for p in getattr(m, "gguf_parts", [])]
    dense = {p.qtype for p in parts if isinstance(p, BlockPart)}
    return dense, {q for m in model.modules() if getattr(m, "block", None) is not None for q in m.block_types}


@pytest.mark.parametrize("layer", range(len(LAYOUT)))
def test_llama_cpp_wrote_each_iq_type_where_the_layout_says(path, layer):
    from ember.loader.gguf import GGUFCheckpoint

    types = {t.name: t.tensor_type.name for t in GGUFCheckpoint(path)._reader.tensors}
    assert [types[f"blk.{layer}.{slot}.weight"] for slot in SLOTS] == LAYOUT[layer]


def test_top20_logprobs_agree_with_llama_cpp_and_nothing_is_dense(path, monkeypatch):
    dequantized = []  # every GGUF matrix ember dequantizes while loading (the dense path)
    real = gguf_blocks.dequantize
    monkeypatch.setattr(gguf_blocks, "dequantize", lambda raw, q, cols: dequantized.append(q) or real(raw, q, cols))
    engine = LLM(path, dtype="float32", kv_cache_memory=0.02, max_model_len=64, num_threads=1, max_num_seqs=1)
    assert not set(dequantized) & set(BLOCK_TYPES), dequantized
    iq = {GGMLQuantizationType[t] for t in IQ_TYPES}
    dense, experts = kept_block_types(engine)
    assert iq <= dense and iq <= experts, (dense, experts)

    ids = torch.randint(3, 300, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20, prompt_logprobs=20)
    ours = engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs
    theirs = llama_logprobs(path, ids)
    gap = 0.0
    for i in range(1, LENGTH):  # ours[i] predicts token i from the logits after token i - 1: theirs[i - 1]
        top = sorted(ours[i], key=lambda t: -ours[i][t].logprob)[:20]
        gap = max(gap, max(abs(ours[i][t].logprob - float(theirs[i - 1, t])) for t in top))
    assert gap < TOLERANCE, gap
