"""MTP speculative decoding end to end on tiny random Qwen3 / Qwen3-MoE models that carry a random
MTP layer (tests/spec/mtp_fixtures.py) in each published layout: greedy output identical to no
speculation under batching + chunked prefill + preemption, drafts proposed (and accepted, with an
MTP layer rigged to predict well), the MTP cache really filled on prefill chunks, seeds, no leaked
blocks after aborts, the pool and the planner counting the MTP layer, and the refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ember import SamplingParams
from ember.config import EngineConfig
from ember.errors import ModelLoadError
from ember.kernels import cpu_tiled_gemv
from ember.spec.mtp_proposer import MTPProposer
from tests.models.tiny_models import random_prompt
from tests.spec.mtp_fixtures import (
    COUNT_KEY,
    LAYOUTS,
    checkpoint_tensors,
    hf_config,
    make_ref_layers,
    write_main_with_mtp,
    write_mtp_folder,
)
from tests.spec.spec_helpers import drafts_after_prefill, kv_gib, make_llm, run, run_with_aborts

pytestmark = pytest.mark.engine  # every test here builds an engine

PROMPTS = [random_prompt(n, 70 + s) for s, n in enumerate([9, 23, 4, 17, 12, 30])]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def mtp_refs(main_dir: str, arch: str, layout: str, seed: int = 1, num_layers: int = 1):
    hf_cfg = hf_config(main_dir)
    return hf_cfg, make_ref_layers(hf_cfg, layout, num_layers, seed=seed, arch=arch)


def write_bigram_model_with_mtp(main_dir: str, dest: str, layout: str) -> str:
    """A tiny Qwen3 turned into a bigram model (every o_proj and layer 1's MLP zeroed, embedding rows
    of RMS 1: the next token depends on the last one only) with an MTP layer that computes exactly
    that model (eh_proj keeps the embedding half, the block is layer 0's with o_proj zeroed, the
    final norm is model.norm): its greedy drafts are the target's greedy tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(main_dir, dest)
    w = load_file(os.path.join(dest, "model.safetensors"))
    with open(os.path.join(dest, "config.json")) as f:
        cfg = json.load(f)
    L, H = cfg["num_hidden_layers"], cfg["hidden_size"]
    assert cfg["tie_word_embeddings"]
    e = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = e / e.pow(2).mean(-1, keepdim=True).sqrt()
    for i in range(L):
        w[f"model.layers.{i}.self_attn.o_proj.weight"].zero_()
        if i > 0:
            w[f"model.layers.{i}.mlp.down_proj.weight"].zero_()
    zc = layout == "qwen3_next"  # zero-centred norms store w - 1
    norm = (lambda t: t - 1.0) if zc else (lambda t: t)
    ones = torch.ones(H)
    block = {k.removeprefix("model.layers.0."): v.clone() for k, v in w.items() if k.startswith("model.layers.0.")}
    block["input_layernorm.weight"] = ones.clone()
    for k in (
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ):
        block[k] = norm(block[k])
    eye, zero = torch.eye(H), torch.zeros(H, H)
    proj = torch.cat([zero, eye] if layout == "mimo" else [eye, zero], dim=1)
    special = {
        "deepseek": ("enorm", "hnorm", "eh_proj", "shared_head.norm"),
        "mimo": ("token_layernorm", "hidden_layernorm", "input_proj", "final_layernorm"),
        "qwen3_next": ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm"),
    }[layout]
    prefix = {"deepseek": f"model.layers.{L}.", "mimo": "model.mtp_layers.0.", "qwen3_next": "mtp."}[layout]
    bprefix = "mtp.layers.0." if zc else prefix
    mtp = {
        prefix + special[0] + ".weight": norm(ones.clone()),
        prefix + special[1] + ".weight": norm(ones.clone()),
        prefix + special[2] + ".weight": proj,
        prefix + special[3] + ".weight": norm(w["model.norm.weight"].clone()),
    }
    mtp.update({bprefix + k: v for k, v in block.items()})
    save_file(
        {k: v.contiguous() for k, v in {**w, **mtp}.items()},
        os.path.join(dest, "model.safetensors"),
        metadata={"format": "pt"},
    )
    cfg[COUNT_KEY[layout]] = 1
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dest


def tensors_for(hf_cfg, refs, layout):
    return checkpoint_tensors(refs, layout, hf_cfg.num_hidden_layers, getattr(hf_cfg, "moe_intermediate_size", 0))


@pytest.fixture(scope="module")
def mtp_model(tiny_model_dir, tmp_path_factory):
    """mtp_model(arch, layout) -> a copy of the tiny model whose checkpoint carries one random MTP layer;
    bigram=True: the bigram Qwen3 with its exact MTP layer (write_bigram_model_with_mtp)."""
    cache = {}

    def get(arch: str, layout: str, bigram: bool = False, num_layers: int = 1) -> str:
        key = (arch, layout, bigram, num_layers)
        if key not in cache:
            main_dir = tiny_model_dir(arch)
            dest = str(tmp_path_factory.mktemp("mtp") / f"{arch}-{layout}-{num_layers}{'-bigram' if bigram else ''}")
            if bigram:
                cache[key] = write_bigram_model_with_mtp(main_dir, dest, layout)
            else:
                hf_cfg, refs = mtp_refs(main_dir, arch, layout, num_layers=num_layers)
                cache[key] = write_main_with_mtp(
                    main_dir, dest, tensors_for(hf_cfg, refs, layout), {COUNT_KEY[layout]: num_layers}
                )
        return cache[key]

    return get


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = run(make_llm(tiny_model_dir(arch), enable_prefix_caching=False), PROMPTS, GREEDY)
        return cache[arch]

    return get


def hard_knobs(path) -> dict:
    """Batching, chunked prefill (budget 7 < most prompts) and preemption (an 18-block pool before the MTP layer takes its share), at once."""
    return dict(
        max_num_batched_tokens=7,
        max_num_seqs=6,
        kv_cache_memory=kv_gib(path, 18),
        max_model_len=48,
        enable_prefix_caching=False,
    )


def check_clean(llm, name=""):
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], name
    return stats


# ---- greedy output ----------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_greedy_output_equals_no_speculation(mtp_model, references, arch, layout):
    path = mtp_model(arch, layout)
    for k in (1, 2, 3):
        llm = make_llm(path, enable_mtp=True, num_speculative_tokens=k, adaptive_spec=False, **hard_knobs(path))
        assert isinstance(llm.engine.parts.spec.proposer, MTPProposer)
        assert run(llm, PROMPTS, GREEDY) == references(arch), (layout, k)
        stats = check_clean(llm, (layout, k))
        assert stats["num_preemptions"] > 0, (layout, k)
        assert stats["spec_num_drafts"] > 0 and stats["spec_num_draft_tokens"] >= stats["spec_num_drafts"]
        if k > 1:  # the recursive steps ran: drafts at position k were verified
            assert stats["spec_num_draft_tokens_per_pos"][k - 1] > 0, (layout, k, stats)


def test_two_mtp_layers_take_turns(mtp_model, references):
    """k = 3 over 2 layers: steps 0, 1, 2 run layers 0, 1, 0; both layers' caches are in the pool."""
    path = mtp_model("qwen3_moe", "deepseek", num_layers=2)
    knobs = dict(hard_knobs(path), kv_cache_memory=kv_gib(path, 22))  # 2 of the 5 layers are MTP's
    llm = make_llm(path, enable_mtp=True, adaptive_spec=False, num_speculative_tokens=3, **knobs)
    assert llm.engine.parts.spec.proposer.num_layers == 2 and len(llm.engine.parts.runner.extra_kv_caches) == 2
    assert run(llm, PROMPTS, GREEDY) == references("qwen3_moe")
    stats = check_clean(llm)
    assert stats["spec_num_draft_tokens_per_pos"][2] > 0 and stats["num_preemptions"] > 0
    assert make_llm(path, enable_mtp=True).engine.parts.spec.k_max == 2  # no k given: the number of layers


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_mtp_that_predicts_well_gets_whole_drafts_accepted(mtp_model, layout):
    path = mtp_model("qwen3", layout, bigram=True)
    ref = run(make_llm(path, enable_prefix_caching=False), PROMPTS, GREEDY)
    # (adaptive k would stay at 1 here: a tiny model's MTP layer + LM head cost as much as the model)
    llm = make_llm(path, enable_mtp=True, num_speculative_tokens=3, adaptive_spec=False, **hard_knobs(path))
    assert llm.engine.parts.spec.proposer.draft_token_cost > 0.5
    assert run(llm, PROMPTS, GREEDY) == ref
    stats = check_clean(llm)
    assert stats["spec_acceptance_per_pos"] == [1.0, 1.0, 1.0], stats
    assert stats["spec_mean_accepted_length"] > 3.0, stats  # 4 tokens a step, but for the last ones
    # Sampled: a draft is drawn from the MTP's own q = softmax(logits / T) and accepted with
    # min(1, p / q). This MTP's logits are the target's, so q == p and (up to rounding) every draft is
    # accepted; greedy drafts would be accepted only with p(argmax), well below 1 at T = 0.8.
    params = SamplingParams(temperature=0.8, max_tokens=14, seed=7, ignore_eos=True)
    llm = make_llm(path, enable_mtp=True, num_speculative_tokens=3, adaptive_spec=False)
    run(llm, PROMPTS, params)
    stats = check_clean(llm)
    assert stats["spec_num_accepted_tokens"] >= 0.95 * stats["spec_num_draft_tokens"] > 0, stats


def test_reduced_draft_vocabulary_drafts_its_token_ids(mtp_model, tmp_path):
    """A head over a subset of the vocabulary (`shared_head.draft_vocab`): the draft is
    draft_vocab[argmax], so with every greedy token inside the subset the drafts stay exact."""
    from safetensors.torch import load_file, save_file

    from ember.models.mtp import MTPModule

    if not hasattr(MTPModule, "propose_greedy"):
        pytest.skip("reduced draft vocabularies are not in ember.models.mtp yet")
    src = mtp_model("qwen3", "deepseek", bigram=True)
    ref = run(make_llm(src, enable_prefix_caching=False), PROMPTS, GREEDY)
    import shutil

    dest = str(tmp_path / "dv")
    shutil.copytree(src, dest)
    w = load_file(os.path.join(dest, "model.safetensors"))
    L = json.load(open(os.path.join(dest, "config.json")))["num_hidden_layers"]
    used = sorted({t for out in ref for t in out})
    extra = [t for t in range(0, 1000, 7) if t not in used]
    w[f"model.layers.{L}.shared_head.draft_vocab"] = torch.tensor(extra[:40] + used + extra[40:80], dtype=torch.int64)
    save_file(w, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    llm = make_llm(dest, enable_mtp=True, num_speculative_tokens=3, adaptive_spec=False)
    assert llm.engine.parts.spec.proposer.mtp.layers[0].draft_vocab.numel() == len(used) + 80
    assert run(llm, PROMPTS, GREEDY) == ref
    stats = check_clean(llm)
    assert stats["spec_acceptance_per_pos"] == [1.0, 1.0, 1.0], stats


# ---- the MTP cache is filled on every prefill chunk -----------------------------------------------


def test_fills_put_off_while_not_drafting_give_the_same_drafts(mtp_model, references):
    """A request drafts one step in three (adaptive k scripted, as between probes): the steps between put
    their rows off and the next fill runs them in one batch. The drafts are those of filling every step,
    under batching, chunked prefill and preemption (a preempted request's held rows are dropped), and the
    output is the plain run's."""
    path = mtp_model("qwen3", "deepseek")

    def go(put_off: bool):
        llm = make_llm(path, enable_mtp=True, num_speculative_tokens=2, **hard_knobs(path))
        spec, calls, drafts, held = llm.engine.parts.spec, {}, [], []
        proposer = spec.proposer
        after_step, propose = proposer.after_step, proposer.propose

        def k_for(req):
            calls[req.request_id] = calls.get(req.request_id, 0) + 1
            return 2 if calls[req.request_id] % 3 == 0 else 0

        def fill(step, drafting=None):
            after_step(step, drafting if put_off else None)
            held.append(sum(d.rows for d in proposer.deferred.values()))

        def record(requests, max_tokens):
            out = propose(requests, max_tokens)
            drafts.extend((r.request_id, r.num_tokens, d.token_ids) for r, d in zip(requests, out) if d is not None)
            return out

        spec.adaptive.k_for, proposer.after_step, proposer.propose = k_for, fill, record
        tokens = run(llm, PROMPTS, GREEDY)
        stats = check_clean(llm)
        assert stats["num_preemptions"] > 0 and not proposer.deferred
        return tokens, drafts, max(held)

    tokens, drafts, most_held = go(put_off=True)
    every_step_tokens, every_step_drafts, none_held = go(put_off=False)
    assert most_held > 0 and none_held == 0
    assert len(drafts) > 10 and drafts == every_step_drafts
    assert tokens == every_step_tokens == references("qwen3")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mtp_cache_written_on_prefill_chunks(mtp_model, layout):
    path = mtp_model("qwen3", layout)
    prompt = random_prompt(29, 5)
    knobs = dict(enable_mtp=True, num_speculative_tokens=3, adaptive_spec=False, enable_prefix_caching=False)
    whole, kv_whole, s1 = drafts_after_prefill(make_llm(path, max_num_seqs=4, **knobs), prompt)
    chunked, kv_chunked, s2 = drafts_after_prefill(
        make_llm(path, max_num_batched_tokens=6, max_num_seqs=4, **knobs), prompt
    )
    assert (s1, s2) == (1, 5)
    assert len(whole) == 3 and whole == chunked
    assert (kv_whole.flatten(3).abs().amax(-1) > 0).all()  # every prompt position written ...
    # ... the same, chunk by chunk (up to float32 summation order; where the tiled GEMV's AVX2 build
    # rounds x to int16 steps, a 6-row chunk's and the 29-row prompt's x round differently)
    tol = 1e-3 if cpu_tiled_gemv.rounds_x() else 1e-5
    torch.testing.assert_close(kv_chunked, kv_whole, rtol=tol, atol=tol)


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next"])
def test_drafts_equal_a_full_recompute(tiny_model_dir, mtp_model, layout, monkeypatch):
    """Input shift, hidden alignment and recursion: the engine's first draft after a (chunked)
    prefill equals the reference MTP layer run over the whole sequence -- rows (t_{i+1}, i, h_i)
    with the sampled token last, then the drafts appended with the recycled g, full recompute.
    The draft layer stays dense here (on AVX2 its float32 weights would be packed to 8-bit tiles)."""
    from safetensors.torch import load_file

    from ember.quant import rtn_tiled
    from tests.models.tiny_models import load_ember_model
    from tests.spec.mtp_fixtures import MiniPager, ref_logits, ref_mtp

    monkeypatch.setattr(rtn_tiled, "usable", lambda dtype=None: False)

    path = mtp_model("qwen3", layout)
    prompt = random_prompt(21, 8)
    llm = make_llm(
        path, enable_mtp=True, num_speculative_tokens=3, adaptive_spec=False, max_num_batched_tokens=8, max_num_seqs=4
    )
    eng = llm.engine
    eng.add_request("x", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    req = eng.parents["x"].children[0]
    while req.draft is None:
        eng.step()
    drafts, sampled = list(req.draft.token_ids), req.token_ids[-1]

    hf_cfg, refs = mtp_refs(tiny_model_dir("qwen3"), "qwen3", layout)  # the same random layer (same seed)
    main = load_ember_model(path)
    pager = MiniPager()
    caches = [pager.cache(main.cfg, seed=10 + i) for i in range(main.cfg.num_layers)]
    P = len(prompt)
    with torch.inference_mode():
        h = main(torch.tensor(prompt), torch.arange(P), caches, pager.meta([(0, 0, P)]))
    embed = load_file(os.path.join(path, "model.safetensors"))["model.embed_tokens.weight"]  # tied: the LM head
    ids, pos, hid = torch.tensor(prompt[1:] + [sampled]), torch.arange(P), h
    want = []
    for step in range(3):
        g = ref_mtp(refs[0], hf_cfg, embed, ids, pos, hid, layout)
        want.append(int(ref_logits(refs[0], g[-1:], embed).argmax()))
        ids = torch.cat([ids, torch.tensor(want[-1:])])
        pos = torch.cat([pos, torch.tensor([P + step])])
        hid = torch.cat([hid, g[-1:]])
    assert drafts == want


# ---- sampling, seeds, aborts --------------------------------------------------------------------------


def test_sampled_runs_reproducible_with_a_seed(mtp_model):
    path = mtp_model("qwen3_moe", "deepseek")
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    outs = [
        run(
            make_llm(path, enable_mtp=True, num_speculative_tokens=2, max_num_batched_tokens=7, max_num_seqs=6),
            PROMPTS,
            params,
        )
        for _ in range(2)
    ]
    assert outs[0] == outs[1]
    other = run(
        make_llm(path, enable_mtp=True, num_speculative_tokens=2),
        PROMPTS,
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=99, ignore_eos=True),
    )
    assert other != outs[0]


def test_no_leaked_blocks_with_aborts(mtp_model):
    path = mtp_model("qwen3", "mimo")
    llm = make_llm(
        path,
        enable_mtp=True,
        num_speculative_tokens=3,
        max_num_batched_tokens=9,
        max_num_seqs=4,
        kv_cache_memory=kv_gib(path, 30),
        max_model_len=64,
    )
    params = SamplingParams(temperature=0.7, max_tokens=20, seed=3, ignore_eos=True)
    run_with_aborts(llm, lambda i: params, PROMPTS * 2)
    stats = check_clean(llm)
    assert stats["spec_num_drafts"] > 0


def test_prefix_cache_hits_keep_greedy_output(mtp_model, tiny_model_dir):
    """Requests that reuse cached blocks (and the MTP K/V in them) start their fill mid-prompt."""
    base = random_prompt(18, 40)
    prompts = [base, base + random_prompt(5, 41), base[:12] + random_prompt(9, 42), base]
    ref = run(make_llm(tiny_model_dir("qwen3"), enable_prefix_caching=False), prompts, GREEDY)
    llm = make_llm(mtp_model("qwen3", "deepseek"), enable_mtp=True, num_speculative_tokens=2, max_num_seqs=1)
    assert run(llm, prompts, GREEDY) == ref
    stats = check_clean(llm)
    assert stats["prefix_cache_hits"] > 0 and stats["spec_num_drafts"] > 0


# ---- a separate MTP folder ------------------------------------------------------------------------------


def test_separate_mtp_folder_is_recognised_without_a_method(tiny_model_dir, references, tmp_path):
    main_dir = tiny_model_dir("qwen3")
    hf_cfg, refs = mtp_refs(main_dir, "qwen3", "deepseek")
    folder = write_mtp_folder(
        str(tmp_path / "qwen3-mtp"),
        tensors_for(hf_cfg, refs, "deepseek"),
        {
            "architectures": ["Qwen3MTP"],
            "num_nextn_predict_layers": 1,
            "vocab_size": hf_cfg.vocab_size,
            "hidden_size": hf_cfg.hidden_size,
        },
    )
    llm = make_llm(main_dir, speculative_model=folder, num_speculative_tokens=2, **hard_knobs(main_dir))
    assert llm.engine.config.speculative.method == "mtp"
    assert run(llm, PROMPTS, GREEDY) == references("qwen3")
    assert check_clean(llm)["spec_num_drafts"] > 0


# ---- sizing ---------------------------------------------------------------------------------------------


def test_pool_and_planner_count_the_mtp_layer(mtp_model):
    from ember.engine import planner

    path = mtp_model("qwen3", "qwen3_next")
    plain = make_llm(path, kv_cache_memory=kv_gib(path, 96))
    mtp = make_llm(path, kv_cache_memory=kv_gib(path, 96), enable_mtp=True)
    layers = plain.engine.parts.loaded.model_config.num_layers
    assert plain.engine.parts.kv.num_blocks == 96
    assert mtp.engine.parts.kv.num_blocks == 96 * layers // (layers + 1)  # one more layer per token
    assert len(mtp.engine.parts.runner.extra_kv_caches) == 1
    assert mtp.engine.parts.spec.k_max == 1  # no k given: the number of MTP layers, as vLLM
    p0 = planner.plan(EngineConfig(model=path, device="cpu", dtype="float32"), memory_gib=4)
    p1 = planner.plan(
        EngineConfig(model=path, device="cpu", dtype="float32", enable_mtp=True, num_speculative_tokens=2), memory_gib=4
    )
    assert (p0.kv_layers, p1.kv_layers) == (layers, layers + 1)
    assert p1.kv_bytes_per_token * layers == p0.kv_bytes_per_token * (layers + 1)
    # The engine's pool per token is the planner's: one more layer of the same shape.
    eng = mtp.engine
    assert eng.parts.spec.kv_bytes_per_token(4) == p1.kv_bytes_per_token - p0.kv_bytes_per_token


def test_planner_counts_a_separate_mtp_folder(tiny_model_dir, tmp_path):
    from ember.engine import planner
    from ember.entrypoints.cli import main as cli_main

    main_dir = tiny_model_dir("qwen3")
    folder = tmp_path / "two"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3MTP"], "num_nextn_predict_layers": 2}))
    kw = dict(model=main_dir, device="cpu", dtype="float32")
    base = planner.plan(EngineConfig(**kw), memory_gib=4)
    p = planner.plan(EngineConfig(num_speculative_tokens=3, speculative_model=str(folder), **kw), memory_gib=4)
    assert p.kv_layers == base.kv_layers + 2
    # an MTP folder alone speculates with k = its layers, as the engine does: counted the same
    assert planner.plan(EngineConfig(speculative_model=str(folder), **kw), memory_gib=4).kv_layers == p.kv_layers
    assert (
        cli_main(
            [
                "plan",
                main_dir,
                "--device",
                "cpu",
                "--memory",
                "4",
                "--num-speculative-tokens",
                "2",
                "--speculative-model",
                str(folder),
                "--json",
            ]
        )
        == 0
    )


# ---- refusals ----------------------------------------------------------------------------------------------


def test_mtp_without_mtp_weights_is_refused(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    with pytest.raises(ModelLoadError, match="holds no MTP weights; looked for model.layers.{N}.enorm"):
        make_llm(path, enable_mtp=True)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"architectures": ["Qwen3MTP"], "vocab_size": 999}, "have vocab_size 999 but the model has 1000"),
        ({"architectures": ["Qwen3MTP"], "hidden_size": 32}, "have hidden_size 32 but the model has 64"),
        ({"architectures": ["DeepseekV3MTP"]}, "is not an MTP model for this Qwen3ForCausalLM model"),
    ],
)
def test_mismatched_mtp_folder_is_refused_through_the_engine(tiny_model_dir, tmp_path, config, message):
    main_dir = tiny_model_dir("qwen3")
    hf_cfg, refs = mtp_refs(main_dir, "qwen3", "deepseek")
    folder = write_mtp_folder(str(tmp_path / "bad"), tensors_for(hf_cfg, refs, "deepseek"), config)
    with pytest.raises(ModelLoadError, match=message):
        make_llm(main_dir, speculative_model=folder, num_speculative_tokens=2)  # taken as MTP: "...MTP" class


def test_cli_refuses_mtp_without_mtp_weights(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ember.entrypoints.cli",
            "generate",
            "hi",
            "--model",
            path,
            "--enable-mtp",
            "--dtype",
            "float32",
            "--kv-cache-memory",
            "0.01",
            "--max-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert res.returncode != 0
    assert "holds no MTP weights" in res.stderr and "--speculative-model DIR" in res.stderr, res.stderr[-2000:]


# ---- the default model's MTP head ----------------------------------------------------------------------------


def test_default_model_speculates_with_its_mtp_head_unless_told_not_to(tmp_path, monkeypatch):
    import argparse

    import ember.default_model as dm
    from ember.config import EngineConfig
    from ember.config.engine_args import add_engine_args, engine_config_from_args

    monkeypatch.setattr(dm, "DEFAULT_MTP_DIR", str(tmp_path / "missing"))
    assert EngineConfig().speculative is None  # no head installed: no speculation
    head = tmp_path / "smollm2-mtp"
    head.mkdir()
    (head / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(dm, "DEFAULT_MTP_DIR", str(head))
    monkeypatch.setattr("ember.config.speculative.DEFAULT_MODEL_MTP_BY_DEFAULT", False)
    assert EngineConfig().speculative is None  # the switch off: only when asked
    assert EngineConfig(enable_mtp=True).speculative.model == str(head)
    monkeypatch.setattr("ember.config.speculative.DEFAULT_MODEL_MTP_BY_DEFAULT", True)  # as shipped
    s = EngineConfig().speculative
    assert (s.method, s.model, s.num_speculative_tokens, s.adaptive) == ("mtp", str(head), dm.DEFAULT_MTP_TOKENS, True)
    assert s.disable_by_batch_size == dm.DEFAULT_MTP_DISABLE_BY_BATCH_SIZE
    assert EngineConfig(num_speculative_tokens=2).speculative.num_speculative_tokens == 2
    assert EngineConfig(enable_mtp=True).speculative.model == str(head)
    assert EngineConfig(enable_mtp=False).speculative is None
    assert EngineConfig(model="some/model").speculative is None  # another model: its own business
    assert EngineConfig(speculative_model="ngram", num_speculative_tokens=2).speculative.method == "ngram"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--no-enable-mtp"])).speculative is None
    assert engine_config_from_args(parser.parse_args([])).speculative.method == "mtp"


def test_default_model_greedy_output_identical_with_its_mtp_head():
    from ember import LLM
    from ember.default_model import default_mtp_path

    if default_mtp_path() is None:
        pytest.skip("the default model's MTP head (ember/assets/smollm2-mtp) is not installed")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    # fp32 (dequantized, as tests/default_model/conftest.py): in bf16 a verify's rows and a plain decode
    # are different matmul shapes, and a near-tie (margin ~1e-2, as in the second prompt) can flip.
    knobs = dict(max_model_len=256, kv_cache_memory=0.05, dtype="float32", quantization="none")
    with_mtp = LLM(enable_mtp=True, **knobs)
    assert with_mtp.engine.config.speculative.method == "mtp"
    # One request at a time: with two running, the default drafts nothing (disable_by_batch_size 2).
    outs = [with_mtp.generate(p, params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    stats = check_clean(with_mtp)
    assert stats["spec_num_drafts"] > 0 and stats["spec_num_accepted_tokens"] > 0
    plain = LLM(enable_mtp=False, **knobs)
    assert plain.engine.parts.spec is None
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)] == outs


def test_sampled_mtp_drafts_keep_the_distribution(mtp_model):
    """Sampled requests draft from the (random, so q != p) MTP's own distribution q and hand q to the
    rejection sampler: the joint law of the first 3 tokens (2 and 3 from verify steps) is unchanged."""
    from tests.models.tiny_models import random_prompt
    from tests.spec.test_spec_engine import two_sample_pvalue

    path = mtp_model("qwen3", "deepseek")
    prompt = random_prompt(6, 3)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)

    def sample(llm):
        torch.manual_seed(0)
        return [tuple(t) for t in run(llm, [prompt] * 1200, params)]

    base = sample(make_llm(path, max_num_seqs=32))
    llm = make_llm(path, max_num_seqs=32, enable_mtp=True, num_speculative_tokens=2, adaptive_spec=False)
    spec = sample(llm)
    stats = check_clean(llm)
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats
    assert two_sample_pvalue(base, spec) > 1e-3


@pytest.mark.parametrize("tiled", [True, False])
def test_cpu_packs_the_mtp_layer_and_still_drafts(mtp_model, monkeypatch, tiled):
    """On CPU the draft layer's Linears and own head run as 8-bit tiles (ember.quant.rtn_tiled) in the
    tiled kernel's dtype (bf16 on AVX-512 BF16, float32 on AVX2), else in bf16 as int4
    (ember.quant.rtn_int4); the exact bigram MTP still gets most drafts accepted (RTN moves its
    logits a little)."""
    from ember.quant import rtn_tiled
    from ember.quant.rtn_int4 import RTNInt4Method

    if tiled and not rtn_tiled.usable():
        pytest.skip("the tiled GEMV needs AVX-512 BF16 or AVX2, and a compiler")
    if not tiled:
        monkeypatch.setattr(rtn_tiled, "usable", lambda dtype=None: False)
    dtype = str(cpu_tiled_gemv.x_dtype()).removeprefix("torch.") if tiled else "bfloat16"
    path = mtp_model("qwen3", "deepseek", bigram=True)
    llm = make_llm(path, dtype=dtype, enable_mtp=True, num_speculative_tokens=2, adaptive_spec=False)
    proposer = llm.engine.parts.spec.proposer
    assert proposer.packed_bytes_saved > 0
    method = proposer.mtp.layers[0].block.mlp.down_proj.quant_method
    assert isinstance(method, rtn_tiled.RTNTiledMethod if tiled else RTNInt4Method)
    run(llm, PROMPTS, GREEDY)
    stats = check_clean(llm)
    assert stats["spec_num_accepted_tokens"] > 0.5 * stats["spec_num_draft_tokens"], stats
    if cpu_tiled_gemv.x_dtype() != torch.float32:  # float32 layers stay dense where the kernel takes bf16
        fp32 = make_llm(path, dtype="float32", enable_mtp=True, num_speculative_tokens=2)
        assert fp32.engine.parts.spec.proposer.packed_bytes_saved == 0


def test_default_model_dense_with_int8_decode_copy_loads_its_mtp_head():
    """--quantization none on the default model wraps the LM head for int8 decode before the MTP
    head loads; the head's loader reads vocab_size through the wrapper."""
    from ember import LLM
    from ember.default_model import default_mtp_path

    if default_mtp_path() is None:
        pytest.skip("the default model's MTP head (ember/assets/smollm2-mtp) is not installed")
    # bf16: the int8 copy is a bf16-activation path (auto is float32 on CPUs without AVX512-BF16)
    llm = LLM(quantization="none", kv_cache_memory=0.05, max_model_len=256, dtype="bfloat16")
    assert llm.engine.parts.copies.int8_decode_bytes > 0 and llm.engine.config.speculative.method == "mtp"
    run(llm, [[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert check_clean(llm)["spec_num_drafts"] > 0
