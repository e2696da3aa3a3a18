"""Files quantized by llama.cpp's own quantizer (llama_model_quantize) to the types ember keeps as the file's
blocks (ember.quant.gguf_block_part; MoE experts through block_moe): ember's top-20 prompt logprobs agree with
llama.cpp's on the same file, and no matrix of those types is dequantized at load.

The model: a tiny random Qwen3-MoE (hidden 256, so every matrix takes 256-element block types; 8 experts of
256, top-2; a 300-token SentencePiece vocabulary, so the file is small and quantizes in well under a second),
written as float32 by gguf-py's writer (tests/loader/test_gguf.tiny_model) with its matrices scaled to a
well-conditioned net. llama.cpp's mixes decide each tensor's type (Q2_K: Q2_K / Q3_K / Q4_K, a Q6_K head;
IQ4_XS: IQ4_XS with Q4_K / Q6_K here and there; ...). Types: FTYPES (the IQ grid types join once llama.cpp
writes them without an importance matrix)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember import LLM, SamplingParams
from ember.kernels import cpu_block_gemv
from ember.quant import gguf_blocks
from ember.quant.gguf_block_part import BLOCK_TYPES, BlockPart
from tests.loader.test_gguf import tiny_model, write_gguf
from tests.models.tiny_models import one_thread  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.engine,
    pytest.mark.skipif(not cpu_block_gemv.available(), reason="needs a C++ compiler"),
]
llama_cpp = pytest.importorskip("llama_cpp")  # the bench extra: pip install -e '.[bench]'

FTYPES = ["Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "IQ4_XS"]
# max |ember - llama.cpp| over ember's top 20 at every position of a 24-token prompt; both round x to int8
# per block the same way, so the gap is the two engines' float32 summation orders (measured: TOLERANCE_NOTE)
TOLERANCE = 2e-2
EXPERTS, TOP_K, LENGTH = 8, 2, 24


def spm_vocab(n_pieces: int) -> dict:
    """A SentencePiece vocabulary of <unk>, <s>, </s>, the 256 byte pieces and n_pieces made-up words."""
    pieces = [f"▁w{i}" for i in range(n_pieces)]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces,
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * n_pieces,
        "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(n_pieces)],
        "tokenizer.ggml.unknown_token_id": 0,
    }


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from ember.bench.peers.llamacpp_convert import quantize

    root = tmp_path_factory.mktemp("block-types")
    vocab = spm_vocab(41)
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    moe = {"qwen3moe.expert_count": EXPERTS, "qwen3moe.expert_used_count": TOP_K}
    moe["qwen3moe.expert_feed_forward_length"] = 256
    meta, tensors = tiny_model(
        "qwen3moe", layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=n_vocab, experts=EXPERTS,
        moe_ffn=256, extra_meta=moe | vocab,
    )  # fmt: skip
    for name, w in tensors.items():  # a unit-variance random net is chaotic at hidden 256: scale it down
        if w.ndim >= 2 and name != "token_embd.weight":
            w *= 0.6 / np.sqrt(w.shape[-1])
        elif w.ndim == 1:
            tensors[name] = 1 + 0.1 * w
    f32 = str(write_gguf(root / "moe.f32.gguf", "qwen3moe", meta, tensors))
    return {ftype: quantize(f32, str(root / f"moe.{ftype.lower()}.gguf"), ftype, threads=1) for ftype in FTYPES}


def llama_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """llama.cpp's log-probabilities after every prompt token, [len(ids), vocab] float64."""
    peer = llama_cpp.Llama(path, logits_all=True, n_threads=1, n_ctx=64, verbose=False)
    peer.eval(ids)
    out = torch.log_softmax(torch.tensor(peer.scores[: len(ids)]).double(), -1)
    peer.close()
    return out


def block_types_in(path: str) -> set:
    from ember.loader.gguf import GGUFCheckpoint

    return {t.tensor_type for t in GGUFCheckpoint(path)._reader.tensors} & set(BLOCK_TYPES)


@pytest.mark.parametrize("ftype", FTYPES)
def test_top20_logprobs_agree_with_llama_cpp_and_nothing_is_dense(files, ftype, monkeypatch):
    path = files[ftype]
    in_file = block_types_in(path)
    assert in_file, f"llama.cpp wrote no block-kernel type for {ftype}"
    dequantized = []  # every GGUF matrix ember dequantizes while loading (the dense path)
    real = gguf_blocks.dequantize
    monkeypatch.setattr(
        gguf_blocks, "dequantize", lambda raw, qtype, cols: dequantized.append(qtype) or real(raw, qtype, cols)
    )
    engine = LLM(path, dtype="float32", kv_cache_memory=0.02, max_model_len=64, num_threads=1, max_num_seqs=1)
    assert not set(dequantized) & set(BLOCK_TYPES), dequantized
    model = engine.engine.parts.runner.model
    parts = [p for m in model.modules() for p in getattr(m, "gguf_parts", [])]
    parts += [m.quant_method.part for m in (model.model.embed_tokens, model.lm_head)]
    kept = {p.qtype for p in parts if isinstance(p, BlockPart)}
    kept |= {q for m in model.modules() if getattr(m, "block", None) is not None for q in m.block_types}
    assert in_file <= kept, (in_file, kept)

    ids = torch.randint(3, 300, (LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20, prompt_logprobs=20)
    ours = engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0].prompt_logprobs
    theirs = llama_logprobs(path, ids)
    gap = 0.0
    for i in range(1, LENGTH):  # ours[i] predicts token i from the logits after token i - 1: theirs[i - 1]
        top = sorted(ours[i], key=lambda t: -ours[i][t].logprob)[:20]
        gap = max(gap, max(abs(ours[i][t].logprob - float(theirs[i - 1, t])) for t in top))
    assert gap < TOLERANCE, gap
