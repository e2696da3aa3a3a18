"""Files quantized by llama.cpp's own quantizer (llama_model_quantize) to the types ember keeps as the file's
blocks (ember.quant.gguf_block_part; MoE experts through block_moe): ember's top-20 logprobs agree with
llama.cpp's on the same file at every position of a prompt (a 20-token prefill, then 4 single-token decode
steps: the kernels' many-row and one-row paths), and no matrix of those types is dequantized at load.

The model: a tiny random Qwen3-MoE (hidden 256, so every matrix takes 256-element block types; 8 experts of
256, top-2; a 300-token SentencePiece vocabulary, so the file is small and quantizes in a fraction of a
second), written as float32 by gguf-py's writer (tests/loader/test_gguf.tiny_model) with its matrices scaled
to a well-conditioned net, and built straight from the file as the engine builds it (no engine around it:
~1 s a file). llama.cpp's mixes decide each tensor's type (Q2_K: Q2_K / Q3_K / Q4_K and a Q6_K head; IQ4_XS:
IQ4_XS with Q4_K / Q6_K here and there; ...). The IQ1 / IQ2 / IQ3_XXS types need an importance matrix, so
they get a uniform one (llamacpp_convert.quantize's uniform_imatrix: plain squared error)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ember.kernels import cpu_block_gemv
from ember.kernels.cpu_kernels import CpuKernels
from ember.quant import gguf_blocks
from ember.quant.gguf_block_part import BLOCK_TYPES, BlockPart
from tests.loader.test_gguf import tiny_model, write_gguf
from tests.models.tiny_models import PagedDriver, Seq, one_thread  # noqa: F401 (fixture)

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not cpu_block_gemv.available(), reason="needs a C++ compiler"),
]
llama_cpp = pytest.importorskip("llama_cpp")  # the bench extra: pip install -e '.[bench]'

# llama_ftype -> whether llama.cpp needs an importance matrix for it (a uniform one here). The default lane
# runs the types llama.cpp quantizes quickly; the six that need a matrix cost ~40 s more of quantizing (IQ1_S
# alone ~7 s at this size): EMBER_TEST_IQ_GRID=1 adds them (they passed here: TOLERANCE's note).
FTYPES = {"Q2_K": False, "Q3_K_S": False, "Q3_K_M": False, "IQ4_NL": False, "IQ4_XS": False, "IQ3_S": False}
if os.environ.get("EMBER_TEST_IQ_GRID"):
    FTYPES |= {t: True for t in ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")}
HEAD_GAIN = 1.2  # the LM head's scale (the other matrices' 0.6): logits spread over ~10
EXPERTS, TOP_K, PROMPT, DECODE = 4, 2, 20, 4


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
    from ember.bench.peers.llamacpp_convert import quantize_many

    root = tmp_path_factory.mktemp("block-types")
    vocab = spm_vocab(41)
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    moe = {"qwen3moe.expert_count": EXPERTS, "qwen3moe.expert_used_count": TOP_K}
    moe["qwen3moe.expert_feed_forward_length"] = 256
    meta, tensors = tiny_model(
        "qwen3moe", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=64, vocab=n_vocab, experts=EXPERTS,
        moe_ffn=256, extra_meta=moe | vocab,
    )  # fmt: skip
    for name, w in tensors.items():  # a unit-variance random net is chaotic at hidden 256: scale it down
        if w.ndim >= 2 and name != "token_embd.weight":
            w *= (HEAD_GAIN if name == "output.weight" else 0.6) / np.sqrt(w.shape[-1])
        elif w.ndim == 1:
            tensors[name] = 1 + 0.1 * w
    f32 = str(write_gguf(root / "moe.f32.gguf", "qwen3moe", meta, tensors))
    out = {ftype: str(root / f"moe.{ftype.lower()}.gguf") for ftype in FTYPES}
    quantize_many(f32, {out[ftype]: (ftype, imatrix) for ftype, imatrix in FTYPES.items()}, threads=1)
    return out


def build(path: str, kernels: CpuKernels):
    """The model as the engine builds a GGUF file (packed parts, with these kernels), float32."""
    from ember.config.model_config import ModelConfig
    from ember.loader.gguf import GGUFCheckpoint
    from ember.models.registry import get_model_class
    from ember.quant import process_weights_after_loading
    from ember.quant.gguf_quant import GGUFConfig

    ckpt = GGUFCheckpoint(path)
    cfg = ModelConfig.from_dict(ckpt.config)
    quant = GGUFConfig()
    quant.kernels = kernels  # as resolve_quant_config sets it
    model = get_model_class(cfg.architecture)(cfg, dtype=torch.float32, device="cpu", quant_config=quant)
    model.load_weights(ckpt.iter_weights(packed=True))
    process_weights_after_loading(model)
    return model.eval()


def ember_logprobs(model, ids: list[int]) -> torch.Tensor:
    """ember's log-probabilities after each of ids: the first PROMPT as one prefill, the rest a token a step."""
    driver, seq = PagedDriver(model), Seq(prompt=ids[:PROMPT], max_new=0)
    logits = driver.step([(seq, PROMPT)])
    for t in ids[PROMPT:]:
        seq.tokens.append(t)
        logits += driver.step([(seq, 1)])
    return torch.log_softmax(torch.cat(logits).double(), -1)


def llama_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """llama.cpp's log-probabilities after each of ids, [len(ids), vocab] float64."""
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
    monkeypatch.setattr(gguf_blocks, "dequantize", lambda raw, q, cols: dequantized.append(q) or real(raw, q, cols))
    model = build(path, CpuKernels())
    assert not set(dequantized) & set(BLOCK_TYPES), dequantized
    parts = [p for m in model.modules() for p in getattr(m, "gguf_parts", [])]
    parts += [m.quant_method.part for m in (model.model.embed_tokens, model.lm_head)]
    kept = {p.qtype for p in parts if isinstance(p, BlockPart)}
    kept |= {q for m in model.modules() if getattr(m, "block", None) is not None for q in m.block_types}
    assert in_file <= kept, (in_file, kept)

    ids = torch.randint(3, 300, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = ember_logprobs(model, ids)
    top = ours.topk(20, dim=-1).indices
    gaps = {}
    for peer, theirs in (("llama.cpp", llama_logprobs(path, ids)), ("dense", ember_logprobs(dense(path), ids))):
        gaps[peer] = (ours.gather(1, top) - theirs.gather(1, top)).abs().amax(1)  # [positions]
    # The gaps: TOLERANCE's note. One position may sit on a near-tie of the router (two experts' scores equal
    # to rounding), where an engine that rounds x differently picks the other expert.
    for peer, (typical, anywhere) in TOLERANCE.items():
        g = gaps[peer].sort().values
        assert g[-2] < typical and g[-1] < anywhere, (peer, gaps[peer])


def dense(path: str):
    """The same file with the block-kernel types dequantized at load (--no-cpu-block-gemv): exact weights,
    float32 x, what ember ran before."""
    return build(path, CpuKernels(block_gemv=False))


# max |d logprob| over ember's top 20 at a position: (every position but one, every position). Measured here (2
# cores, AVX2) on the 12 files (the six above and the six EMBER_TEST_IQ_GRID adds), (median, 2nd largest,
# largest) over the 24 positions: against llama.cpp 0.017-0.020, 0.023-0.030, 0.024-0.034 -- as far as ember's
# own dense path is from llama.cpp, so it is the engines' other roundings (llama.cpp rounds x to int8 for its
# Q5_K / Q6_K / Q8_0 matrices and the Q6_K head too, where ember's tiled parts round it to int16 steps), not the
# block kernels; against ember's dense path (these types dequantized at load, float32 x) 0.004-0.008,
# 0.005-0.012, 0.006-0.020, but 0.22 at one position of the Q2_K file: a router near-tie that the dense path,
# with x unrounded, settles the other way than llama.cpp and the block kernels (both 0.03 from each other there).
TOLERANCE = {"llama.cpp": (0.05, 0.1), "dense": (0.02, 1.0)}
