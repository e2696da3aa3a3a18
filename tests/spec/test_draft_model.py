"""Draft-model speculative decoding (ember/spec/draft.py) on tiny random models that share the
tiny tokenizer: the target (2-layer Qwen3) drafting for itself (a copy of its folder: every draft
must be accepted at temperature 0, a strong check of the draft's KV bookkeeping), a 1-layer
truncation of it (partial acceptance) and a Llama of another shape (other kv heads and head_dim).
Greedy output identical to no speculation under batching + chunked prefill + preemption; sampled
tokens distributed as the target's (chi-square); seeds; prefix caching; no leaked blocks after
aborts; the pool counting the draft's layers; the refusals."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ember import SamplingParams
from ember.config import EngineConfig
from ember.config.model_config import ModelConfig
from ember.errors import ConfigError
from ember.spec.draft import DraftModelProposer
from tests.models.tiny_models import random_prompt
from tests.spec.spec_helpers import drafts_after_prefill, kv_gib, make_llm, run, run_with_aborts

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
from tests.models.tiny_models import one_thread  # noqa: E402,F401

PROMPTS = [random_prompt(n, 70 + s) for s, n in enumerate([9, 23, 4, 17, 12, 30])]
GREEDY = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def truncate(src: str, dest: str, layers: int = 1) -> str:
    """A copy of the model with its first `layers` decoder layers only (same embedding, norm, head)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dest)
    w = load_file(os.path.join(dest, "model.safetensors"))
    keep = {k: v for k, v in w.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(keep, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    edit_config(dest, num_hidden_layers=layers)
    with open(os.path.join(dest, "config.json")) as f:
        cfg = json.load(f)
    if isinstance(cfg.get("layer_types"), list):
        edit_config(dest, layer_types=cfg["layer_types"][:layers])
    return dest


def edit_config(folder: str, **kw) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(kw)
    with open(path, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="module")
def drafts(tiny_model_dir, tmp_path_factory):
    """name -> draft folder: 'self' (a copy of the target), 'trunc' (its first layer), 'llama'."""
    target = tiny_model_dir("qwen3")
    root = tmp_path_factory.mktemp("drafts")
    return {
        "self": shutil.copytree(target, str(root / "self")),
        "trunc": truncate(target, str(root / "trunc")),
        "llama": tiny_model_dir("llama"),
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return run(make_llm(tiny_model_dir("qwen3"), enable_prefix_caching=False), PROMPTS, GREEDY)


def pool_gib(target: str, draft: str, blocks: int, block_size: int = 4) -> float:
    """Memory for a pool of `blocks` blocks holding the target's and the draft's layers (fp32)."""
    per = sum(ModelConfig.from_folder(p).kv_bytes_per_token_per_dtype_byte * 4 for p in (target, draft))
    return blocks * block_size * per / 2**30


def hard_knobs(target: str, draft: str) -> dict:
    """Batching, chunked prefill (budget 9 < most prompts) and preemption (a 12-block pool), at once."""
    return dict(
        max_num_batched_tokens=9,
        max_num_seqs=6,
        kv_cache_memory=pool_gib(target, draft, 12),
        max_model_len=48,
        enable_prefix_caching=False,
    )


def check_clean(llm, name=""):
    stats = llm.engine.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], name
    return stats


def acceptance(stats) -> float:
    return stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]


# ---- greedy output --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["self", "trunc", "llama"])
def test_greedy_output_equals_no_speculation(tiny_model_dir, drafts, reference, name):
    target, draft = tiny_model_dir("qwen3"), drafts[name]
    for k in (1, 2, 3):
        llm = make_llm(
            target, speculative_model=draft, num_speculative_tokens=k, adaptive_spec=False, **hard_knobs(target, draft)
        )
        assert llm.engine.config.speculative.method == "draft"
        assert isinstance(llm.engine.parts.spec.proposer, DraftModelProposer)
        assert run(llm, PROMPTS, GREEDY) == reference, (name, k)
        stats = check_clean(llm, (name, k))
        assert stats["num_preemptions"] > 0, (name, k)
        assert stats["spec_num_draft_tokens_per_pos"][k - 1] > 0, (name, k, stats)
        if name == "self":  # the target drafting for itself: its drafts are its own greedy tokens
            assert acceptance(stats) > 0.95, (k, stats)
            # fp32 and the same weights: exactly all, at every position (a stale K/V row shows here)
            assert stats["spec_acceptance_per_pos"] == [1.0] * k, (k, stats)
        if name == "trunc":
            assert 0 < acceptance(stats) < 1, (k, stats)


def test_json_spelling_and_the_pool_counts_the_draft_layers(tiny_model_dir, drafts):
    target, draft = tiny_model_dir("qwen3"), drafts["llama"]
    plain = make_llm(target, kv_cache_memory=kv_gib(target, 96))
    llm = make_llm(
        target,
        kv_cache_memory=kv_gib(target, 96),
        speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2},
    )
    eng, dmc, tmc = llm.engine, ModelConfig.from_folder(draft), plain.engine.parts.loaded.model_config
    assert eng.config.speculative.method == "draft" and eng.parts.spec.k_max == 2
    assert plain.engine.parts.kv.num_blocks == 96
    t_tok = tmc.kv_bytes_per_token_per_dtype_byte
    d_tok = dmc.kv_bytes_per_token_per_dtype_byte
    assert eng.parts.kv.num_blocks == 96 * t_tok // (t_tok + d_tok)
    assert eng.parts.spec.kv_bytes_per_token(4) == d_tok * 4
    caches = eng.parts.runner.extra_kv_caches
    assert len(caches) == dmc.num_layers
    scratch = eng.parts.limits.max_num_seqs * eng.parts.spec.proposer.scratch_per_req
    assert caches[0].shape[1:] == (eng.parts.kv.num_blocks + scratch, 4, dmc.num_kv_heads, dmc.head_dim)


def test_planner_counts_the_draft_model(tiny_model_dir, drafts, capsys):
    from ember.engine import planner
    from ember.entrypoints.cli import main as cli_main

    target, draft = tiny_model_dir("qwen3"), drafts["llama"]
    kw = dict(model=target, device="cpu", dtype="float32")
    base = planner.plan(EngineConfig(**kw), memory_gib=4)
    p = planner.plan(EngineConfig(num_speculative_tokens=2, speculative_model=draft, **kw), memory_gib=4)
    d_tok = ModelConfig.from_folder(draft).kv_bytes_per_token_per_dtype_byte * 4
    assert p.draft_kv_bytes_per_token == d_tok and p.kv_bytes_per_token == base.kv_bytes_per_token + d_tok
    assert p.kv_layers == base.kv_layers and p.weight_bytes > base.weight_bytes
    llm = make_llm(target, speculative_model=draft, num_speculative_tokens=2)
    assert llm.engine.parts.spec.kv_bytes_per_token(4) == p.draft_kv_bytes_per_token  # the engine's pool, the same way
    assert (
        cli_main(
            [
                "plan",
                target,
                "--device",
                "cpu",
                "--memory",
                "4",
                "--dtype",
                "float32",
                "--num-speculative-tokens",
                "2",
                "--speculative-model",
                draft,
            ]
        )
        == 0
    )
    assert f"+ {d_tok:,} B draft model" in capsys.readouterr().out


def test_cpu_paged_attention_knob_reaches_the_draft_model(tiny_model_dir, drafts):
    target, draft = tiny_model_dir("qwen3"), drafts["trunc"]
    for on in (True, False):
        llm = make_llm(target, speculative_model=draft, num_speculative_tokens=2, cpu_paged_attention=on)
        target_model, draft_model = llm.engine.parts.loaded.model, llm.engine.parts.spec.proposer.model
        backends = [target_model.attn_backend, draft_model.attn_backend]
        layers = (target_model.model.layers[0], draft_model.model.layers[0])
        assert all(b is m.self_attn.attn.backend for b, m in zip(backends, layers))
        assert backends[0] is not backends[1] and [b.fused_decode for b in backends] == [on, on]


# ---- chunked prefill and prefix caching -------------------------------------------------------------


def test_draft_cache_written_on_prefill_chunks(tiny_model_dir, drafts):
    target, draft = tiny_model_dir("qwen3"), drafts["trunc"]
    prompt = random_prompt(29, 5)
    knobs = dict(speculative_model=draft, num_speculative_tokens=3, adaptive_spec=False, enable_prefix_caching=False)
    whole, kv_whole, s1 = drafts_after_prefill(make_llm(target, max_num_seqs=4, **knobs), prompt)
    chunked, kv_chunked, s2 = drafts_after_prefill(
        make_llm(target, max_num_batched_tokens=6, max_num_seqs=4, **knobs), prompt
    )
    assert (s1, s2) == (1, 5)
    assert len(whole) == 3 and whole == chunked
    assert (kv_whole.flatten(3).abs().amax(-1) > 0).all()  # every prompt position written ...
    torch.testing.assert_close(kv_chunked, kv_whole, rtol=1e-5, atol=1e-5)  # ... the same, chunk by chunk


def test_prefix_cache_hits_keep_the_draft_exact(tiny_model_dir, drafts):
    """Requests that reuse cached blocks reuse the draft's K/V in them: still every draft accepted."""
    target = tiny_model_dir("qwen3")
    base = random_prompt(18, 40)
    prompts = [base, base + random_prompt(5, 41), base[:12] + random_prompt(9, 42), base]
    ref = run(make_llm(target, enable_prefix_caching=False), prompts, GREEDY)
    llm = make_llm(
        target, speculative_model=drafts["self"], num_speculative_tokens=3, adaptive_spec=False, max_num_seqs=1
    )
    assert run(llm, prompts, GREEDY) == ref
    stats = check_clean(llm)
    assert stats["prefix_cache_hits"] > 0 and acceptance(stats) > 0.95, stats


# ---- sampling ---------------------------------------------------------------------------------------


def next_probs(model, tokens: list[int], params) -> torch.Tensor:
    """The target's sampling distribution after `tokens`, by a plain full forward."""
    from ember.layers.sampler import target_probs
    from tests.spec.mtp_fixtures import MiniPager

    pager = MiniPager(num_blocks=16)
    caches = [pager.cache(model.cfg, num_blocks=16) for _ in range(model.cfg.num_layers)]
    with torch.inference_mode():
        h = model(torch.tensor(tokens), torch.arange(len(tokens)), caches, pager.meta([(0, 0, len(tokens))]))
        return target_probs(model.compute_logits(h[-1:]).double(), [params])[0]


def test_sampled_tokens_follow_the_target(tiny_model_dir, drafts):
    """Tokens 2 and 3 (from the verify of 2 drafts sampled from the draft's q) are distributed as
    the target's marginals, computed exactly over top_k = 4."""
    from tests.models.tiny_models import load_ember_model
    from tests.spec.test_rejection import chi2_pvalue

    target = tiny_model_dir("qwen3")
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)
    prompt = random_prompt(7, 3)
    trials = 1500
    llm = make_llm(
        target,
        speculative_model=drafts["trunc"],
        num_speculative_tokens=2,
        adaptive_spec=False,
        max_num_seqs=64,
        max_num_batched_tokens=512,
        kv_cache_memory=pool_gib(target, drafts["trunc"], 1200),
    )
    outs = run(llm, [prompt] * trials, params)
    stats = check_clean(llm)
    assert stats["spec_num_draft_tokens_per_pos"][1] > trials // 2
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"], stats

    model = load_ember_model(target)
    p1 = next_probs(model, prompt, params)
    p2 = torch.zeros_like(p1)
    p3 = torch.zeros_like(p1)
    for a in p1.nonzero().view(-1).tolist():
        pa = next_probs(model, prompt + [a], params)
        p2 += p1[a] * pa
        for b in pa.nonzero().view(-1).tolist():
            p3 += p1[a] * pa[b] * next_probs(model, prompt + [a, b], params)
    for pos, want in ((0, p1), (1, p2), (2, p3)):
        counts = torch.bincount(torch.tensor([o[pos] for o in outs]), minlength=len(want)).double()
        assert chi2_pvalue(counts, want) > 1e-3, (pos, counts.nonzero().view(-1), want.nonzero().view(-1))


def test_seeded_runs_reproducible_and_batch_independent(tiny_model_dir, drafts):
    target, draft = tiny_model_dir("qwen3"), drafts["trunc"]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234, ignore_eos=True)
    knobs = dict(speculative_model=draft, num_speculative_tokens=2, max_num_seqs=6, max_num_batched_tokens=256)
    outs = [run(make_llm(target, **knobs), PROMPTS, params) for _ in range(2)]
    assert outs[0] == outs[1]
    alone = make_llm(target, **knobs)
    assert [run(alone, [p], params)[0] for p in PROMPTS] == outs[0]
    other = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=99, ignore_eos=True)
    assert run(make_llm(target, **knobs), PROMPTS, other) != outs[0]


def test_no_leaked_blocks_with_aborts(tiny_model_dir, drafts):
    target, draft = tiny_model_dir("qwen3"), drafts["llama"]
    llm = make_llm(
        target,
        speculative_model=draft,
        num_speculative_tokens=3,
        max_num_batched_tokens=9,
        max_num_seqs=4,
        kv_cache_memory=pool_gib(target, draft, 30),
        max_model_len=64,
    )
    sampled = SamplingParams(temperature=0.7, max_tokens=20, seed=3, ignore_eos=True)
    run_with_aborts(llm, lambda i: sampled if i % 2 else GREEDY, PROMPTS * 2)
    stats = check_clean(llm)
    assert stats["spec_num_drafts"] > 0


# ---- refusals ---------------------------------------------------------------------------------------------


def spec_config(target: str, draft: str, **kw):
    return EngineConfig(model=target, speculative_model=draft, num_speculative_tokens=2, **kw).speculative


def test_a_missing_draft_folder_is_refused(tiny_model_dir, tmp_path):
    target = tiny_model_dir("qwen3")
    with pytest.raises(ConfigError, match="draft model '.*nowhere' not found; give --speculative-model a local"):
        spec_config(target, str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="not found"):
        EngineConfig(
            model=target,
            speculative_config={"method": "draft", "model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2},
        )


def test_mtp_weights_go_to_mtp_not_draft(tiny_model_dir, tmp_path):
    target = tiny_model_dir("qwen3")
    folder = tmp_path / "mtp"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen3MTP"]}))
    assert spec_config(target, str(folder)).method == "mtp"
    assert spec_config(target, target).method == "mtp"  # the target itself without a method: its MTP layers
    with pytest.raises(ConfigError, match="holds MTP weights, not a draft model; use method 'mtp'"):
        make_llm(target, speculative_config={"method": "draft", "model": str(folder), "num_speculative_tokens": 2})


def test_another_vocab_size_is_refused(tiny_model_dir, drafts, tmp_path):
    target = tiny_model_dir("qwen3")
    bad = shutil.copytree(drafts["llama"], str(tmp_path / "big"))
    edit_config(bad, vocab_size=1200)
    with pytest.raises(ConfigError, match="has vocab_size 1200 but the target has 1000; give a draft model"):
        make_llm(target, speculative_model=bad, num_speculative_tokens=2)


def test_another_tokenizer_is_refused(tiny_model_dir, drafts, tmp_path):
    from tests.conftest import write_tiny_tokenizer

    target = tiny_model_dir("qwen3")
    bad = shutil.copytree(drafts["trunc"], str(tmp_path / "othertok"))
    write_tiny_tokenizer(bad, 900)  # same vocab_size in config.json, another vocabulary
    with pytest.raises(ConfigError, match="has another tokenizer than the target: the vocabularies differ"):
        make_llm(target, speculative_model=bad, num_speculative_tokens=2)


def test_a_draft_folder_without_tokenizer_files_is_checked_by_vocab_size(
    tiny_model_dir, drafts, reference, tmp_path, caplog
):
    target = tiny_model_dir("qwen3")
    bare = shutil.copytree(drafts["self"], str(tmp_path / "bare"))
    os.remove(os.path.join(bare, "tokenizer.json"))
    with caplog.at_level("WARNING", logger="ember"):
        llm = make_llm(target, speculative_model=bare, num_speculative_tokens=2, adaptive_spec=False)
    assert "has no tokenizer.json: only its vocab_size was checked" in caplog.text
    assert run(llm, PROMPTS, GREEDY) == reference
    assert acceptance(check_clean(llm)) == 1.0


def test_a_shorter_draft_context_is_refused(tiny_model_dir, drafts, tmp_path):
    target = tiny_model_dir("qwen3")
    short = shutil.copytree(drafts["trunc"], str(tmp_path / "short"))
    edit_config(short, max_position_embeddings=32)
    with pytest.raises(ConfigError, match="has a context of 32 tokens, less than max_model_len 128"):
        make_llm(target, speculative_model=short, num_speculative_tokens=2)
    make_llm(target, speculative_model=short, num_speculative_tokens=2, max_model_len=32)  # fits
