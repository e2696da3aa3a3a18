"""Qwen's FP8 checkpoints end to end: a block-wise FP8 folder written in a fixture the way Qwen's are
(tests/quant/fp8_checkpoint.py) gives the same greedy tokens as its dequantized float32 twin, with first-token
logprobs within 1e-4 (the fp8 GEMV sums in another order), and the twin the same tokens as transformers.
Dense Qwen3 with Qwen's [128, 128] blocks (one partial block a matrix) and [32, 32] (several, partial edges);
Qwen3.5 in its released VL layout with [32, 32] (fused parts that start mid-block: q | gate, q | k | v, the
Gated DeltaNet's q | k | v | z); qwen4_exp with [32, 32], its experts and an fp8 n-gram table with a
per-tensor weight_scale. Prompts long enough for the prefill panels and decodes for the GEMV."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from tests.models.tiny_models import hf_greedy, one_thread  # noqa: F401
from tests.quant.fp8_checkpoint import write_fp8_pair

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
GEN = 8
PARAMS = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=5)


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in (45, 7)]


def run(path: str, ps: list[list[int]]):
    engine = LLM(path, dtype="float32", executor="eager", max_model_len=256, kv_cache_memory=0.05, max_num_seqs=4)
    outs = engine.generate([{"prompt_token_ids": p} for p in ps], PARAMS, use_tqdm=False)
    return engine, [o.outputs[0] for o in outs]


def assert_same(fp8_outs, twin_outs):
    for a, b in zip(fp8_outs, twin_outs):
        assert a.token_ids == b.token_ids
        diffs = [abs(lp.logprob - b.logprobs[0][t].logprob) for t, lp in a.logprobs[0].items() if t in b.logprobs[0]]
        assert len(diffs) >= 4 and max(diffs) < 1e-4, diffs


def pair(tmp_path_factory, src: str, block) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("fp8pair")
    return write_fp8_pair(src, str(root / "fp8"), str(root / "twin"), block)


def held_fp8(engine) -> int:
    model = engine.engine.parts.runner.model
    return sum(p.numel() for p in model.parameters() if p.dtype == torch.float8_e4m3fn)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from tests.conftest import write_tiny_tokenizer
    from tests.models.tiny_models import VOCAB, build_hf_model, save_hf_model

    hf = build_hf_model("qwen3")
    src = save_hf_model(hf, str(tmp_path_factory.mktemp("qwen3")))
    write_tiny_tokenizer(src, VOCAB)
    return src, prompts(VOCAB)


@pytest.mark.parametrize("block", [(128, 128), (32, 32)])
def test_dense_qwen3_fp8_equals_its_twin_and_transformers(qwen3, tmp_path_factory, block):
    import transformers

    src, ps = qwen3
    fp8, twin = pair(tmp_path_factory, src, block)
    engine, fp8_outs = run(fp8, ps)
    assert held_fp8(engine) > 0.9 * 2 * 4 * 64 * 64 * 2  # every projection of the 2 layers
    _, twin_outs = run(twin, ps)
    assert_same(fp8_outs, twin_outs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    assert [o.token_ids for o in twin_outs] == [hf_greedy(hf, p, GEN) for p in ps]


def test_qwen3_5_vl_fp8_with_parts_starting_mid_block(tmp_path_factory):
    from tests.models.tiny_hybrids import VOCAB, build_hybrid, save_hybrid

    src = save_hybrid(build_hybrid("qwen3_5_vl"), str(tmp_path_factory.mktemp("q35")))
    fp8, twin = pair(tmp_path_factory, src, (32, 32))
    engine, fp8_outs = run(fp8, prompts(VOCAB))
    gdn = engine.engine.parts.runner.model.model.layers[0].linear_attn
    assert gdn.in_proj_qkvz.weight.dtype == torch.float8_e4m3fn  # 24 | 24 | 40 | 40 rows on 32-row blocks
    assert gdn.in_proj_qkvz.fp8_scale.shape[0] > -(-gdn.in_proj_qkvz.out_features // 32)
    assert gdn.in_proj_ba.weight.dtype == torch.float32  # in_proj_a / b stay bf16 in Qwen's releases
    assert_same(fp8_outs, run(twin, prompts(VOCAB))[1])


def test_qwen4_exp_fp8_with_experts_and_an_fp8_ngram_table(tmp_path_factory):
    from tests.models.tiny_qwen4 import VOCAB, build_qwen4, save_qwen4

    src = save_qwen4(build_qwen4(), str(tmp_path_factory.mktemp("q4")))
    fp8, twin = pair(tmp_path_factory, src, (32, 32))
    engine, fp8_outs = run(fp8, prompts(VOCAB))
    model = engine.engine.parts.runner.model
    ple = next(layer.ple for layer in model.model.layers if getattr(layer, "ple", None) is not None)
    experts = model.model.layers[0].mlp.experts
    assert experts.w13.dtype == torch.float8_e4m3fn and experts.w2.dtype == torch.float8_e4m3fn
    shards = ple.table.shards
    assert len(shards) == 2 and all(s.tensor.dtype == torch.float8_e4m3fn and s.scale > 0 for s in shards)
    assert_same(fp8_outs, run(twin, prompts(VOCAB))[1])


def test_qwen3_5_fp8_mtp_layer_loads_dequantized(tmp_path_factory):
    """The MTP layer (mtp.*, run dense as ember runs every MTP layer) of an FP8 checkpoint arrives dequantized:
    the same weights as its twin's, and speculation on the fp8 folder keeps the twin's greedy tokens."""
    from ember.loader.model_loader import load_model
    from ember.spec.mtp_weights import load_mtp
    from tests.models.tiny_hybrids import VOCAB, add_mtp, build_hybrid, save_hybrid

    hf = build_hybrid("qwen3_5")
    src = add_mtp(hf, save_hybrid(hf, str(tmp_path_factory.mktemp("q35mtp"))))
    fp8, twin = pair(tmp_path_factory, src, (32, 32))
    layers = []
    for path in (fp8, twin):
        loaded = load_model(path, None, torch.float32, torch.device("cpu"), "torch")
        layers.append(dict(load_mtp(loaded.model, loaded.path, None).named_parameters()))
    assert layers[0].keys() == layers[1].keys() and all(torch.equal(layers[0][k], layers[1][k]) for k in layers[0])
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    engine = LLM(
        fp8, dtype="float32", executor="eager", max_model_len=256, kv_cache_memory=0.05, speculative_config=spec
    )
    drafted = engine.generate([{"prompt_token_ids": p} for p in prompts(VOCAB)], PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.token_ids for o in run(twin, prompts(VOCAB))[1]]
