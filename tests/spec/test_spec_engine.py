"""Speculative decoding end to end on tiny random models: greedy output is identical to no
speculation (batching, chunked prefill, preemption, prefix cache, stops), sampled output keeps
its distribution and its seeds, adaptive k moves, and every block comes back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ember import SamplingParams
from ember.spec.proposer import Draft, Proposer
from tests.models.tiny_models import VOCAB, random_prompt
from tests.spec.spec_helpers import GREEDY, REPEATED, kv_gib, make_llm, ngram, run

pytestmark = pytest.mark.engine  # every test here builds an engine


def scenarios(path):
    return {
        "batched": dict(max_num_seqs=8),
        "chunked": dict(max_num_batched_tokens=7, max_num_seqs=4),
        "preempted": dict(
            kv_cache_memory=kv_gib(path, 20), max_model_len=64, max_num_seqs=8, enable_prefix_caching=False
        ),
    }


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    cache = {}

    def get(arch):
        if arch not in cache:
            cache[arch] = run(make_llm(tiny_model_dir(arch), enable_prefix_caching=False), REPEATED)
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_ngram_greedy_output_equals_no_speculation(tiny_model_dir, references, arch, k):
    path = tiny_model_dir(arch)
    for name, knobs in scenarios(path).items():
        llm = make_llm(path, speculative_config=ngram(k), **knobs)
        assert run(llm, REPEATED) == references(arch), name
        stats = llm.engine.stats()
        assert stats["spec_num_accepted_tokens"] > 0, (name, stats)  # else this proves nothing
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"], name
        if name == "preempted":
            assert stats["num_preemptions"] > 0


def test_disable_by_batch_size_stops_drafting_in_big_batches(tiny_model_dir, references):
    """vLLM's disable_by_batch_size: steps with that many running requests draft nothing (the
    greedy output is the same either way); with fewer running requests it drafts."""
    path = tiny_model_dir("qwen3")
    llm = make_llm(path, max_num_seqs=8, speculative_config=ngram(2, disable_by_batch_size=3))
    assert run(llm, REPEATED) == references("qwen3")
    spec = llm.engine.parts.spec
    assert spec.stats.batch_disabled_steps > 0 and spec.stats.num_draft_tokens == 0  # 6 at once: off
    few = make_llm(path, speculative_config=ngram(2, disable_by_batch_size=3))
    assert run(few, REPEATED[:2]) == references("qwen3")[:2]
    assert few.engine.parts.spec.stats.batch_disabled_steps == 0 and few.engine.parts.spec.stats.num_accepted_tokens > 0


class Oracle(Proposer):
    """Proposes the true greedy continuation, wrong at every `wrong_every`-th position: long
    accepted runs, rejections at every draft position, bonus tokens."""

    num_speculative_tokens = 3

    def __init__(self, prompts, outputs, wrong_every=4):
        self.truth = {tuple(p): p + o for p, o in zip(prompts, outputs)}
        self.wrong_every = wrong_every

    def propose(self, requests, ks):
        drafts = []
        for req, k in zip(requests, ks):
            n = req.num_tokens
            guess = self.truth.get(tuple(req.prompt_token_ids), [])[n : n + k]  # unknown prompt: no guess
            guess = [(t + 1) % VOCAB if (n + j) % self.wrong_every == 0 else t for j, t in enumerate(guess)]
            drafts.append(Draft(guess) if guess else None)
        return drafts


def with_oracle(llm, prompts, outputs, **kw):
    llm.engine.parts.spec.proposer = Oracle(prompts, outputs, **kw)
    return llm


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def long_ref(qwen3):
    prompts = [random_prompt(n, 50 + s) for s, n in enumerate([5, 17, 3, 26, 9, 12])]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    return prompts, run(make_llm(qwen3, enable_prefix_caching=False), prompts, params), params


def test_long_accepted_runs_keep_greedy_output(qwen3, long_ref):
    prompts, ref, params = long_ref
    for name, knobs in scenarios(qwen3).items():
        knobs = dict(knobs, max_model_len=64) if name == "preempted" else knobs
        llm = with_oracle(make_llm(qwen3, speculative_config=ngram(3), adaptive_spec=False, **knobs), prompts, ref)
        assert run(llm, prompts, params) == ref, name
        stats = llm.engine.stats()
        assert stats["spec_num_accepted_tokens_per_pos"][2] > 0, (name, stats)  # whole drafts accepted
        assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # and some rejected
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["spec_mean_accepted_length"] > 2.0


def test_stops_among_accepted_drafts_cut_the_output(qwen3, long_ref):
    prompts, ref, _ = long_ref
    llm = with_oracle(
        make_llm(qwen3, speculative_config=ngram(3), adaptive_spec=False), prompts, ref, wrong_every=10**9
    )
    stop_tok = ref[1][6]
    out = llm.generate(
        {"prompt_token_ids": prompts[1]},
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok]),
        use_tqdm=False,
    )[0]
    cut = ref[1].index(stop_tok) + 1
    assert out.outputs[0].token_ids == ref[1][:cut] and out.outputs[0].finish_reason == "stop"
    for n in (1, 2, 5, 7):
        assert run(llm, [prompts[0]], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)) == [ref[0][:n]]
    text = llm.get_tokenizer().decode(ref[2][:12])
    stop = text[-3:]
    out = llm.generate(
        {"prompt_token_ids": prompts[2]},
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]
    assert llm.engine.parts.kv.num_free_blocks == llm.engine.parts.kv.num_blocks


def test_logprobs_of_verified_tokens_equal_plain_decoding(qwen3, long_ref):
    prompts, ref, _ = long_ref
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    plain = make_llm(qwen3).generate({"prompt_token_ids": prompts[3]}, params, use_tqdm=False)[0].outputs[0]
    llm = with_oracle(make_llm(qwen3, speculative_config=ngram(3)), prompts, ref)
    spec = llm.generate({"prompt_token_ids": prompts[3]}, params, use_tqdm=False)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and llm.engine.stats()["spec_num_accepted_tokens"] > 0
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert list(a) == list(b)
        for t in a:
            assert a[t].rank == b[t].rank and a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4)


def test_prefix_cache_reuses_decoded_blocks_only_with_real_tokens(qwen3, long_ref):
    """A follow-up whose prompt is a speculated conversation so far hits the blocks written by
    verify steps; a block holding rejected K/V would change its output."""
    prompts, ref, params = long_ref
    llm = with_oracle(make_llm(qwen3, speculative_config=ngram(3)), prompts, ref, wrong_every=3)
    first = run(llm, [prompts[1]], params)[0]
    follow = prompts[1] + first + random_prompt(5, 77)
    out = llm.generate({"prompt_token_ids": follow}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens >= (len(prompts[1]) + 20) // 4 * 4  # decoded blocks were named
    assert out.outputs[0].token_ids == run(make_llm(qwen3, enable_prefix_caching=False), [follow])[0]


def test_seeded_sampling_is_reproducible_with_speculation(qwen3):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    llm = make_llm(qwen3, speculative_config=ngram(3))
    alone = run(llm, [REPEATED[1]], params)[0]
    assert llm.engine.stats()["spec_num_drafts"] > 0
    others = [SamplingParams(temperature=0.7, max_tokens=24, ignore_eos=True)] * len(REPEATED)
    others[3] = params
    batch = run(llm, REPEATED[:3] + [REPEATED[1]] + REPEATED[4:], others)
    assert batch[3] == alone
    again = run(make_llm(qwen3, speculative_config=ngram(3)), [REPEATED[1]], params)[0]
    assert again == alone
    assert run(llm, [REPEATED[1]], params.replace(seed=4321))[0] != alone


class RandomDrafts(Proposer):
    """Random guesses among a few tokens, with (q uniform over them) or without draft probs."""

    num_speculative_tokens = 2

    def __init__(self, candidates, with_probs):
        self.cands, self.with_probs = sorted(candidates), with_probs
        self.rng = np.random.default_rng(0)

    def propose(self, requests, ks):
        q = torch.zeros(VOCAB)
        q[self.cands] = 1.0 / len(self.cands)
        out = []
        for k in ks:
            toks = self.rng.choice(self.cands, size=k).tolist()
            out.append(Draft(toks, q.expand(k, VOCAB).clone() if self.with_probs else None))
        return out


def two_sample_pvalue(a: list[tuple], b: list[tuple]) -> float:
    """Chi-square test that two equal-size samples come from one distribution (rare cells pooled)."""
    keys = set(a) | set(b)
    ca = {k: a.count(k) for k in keys}
    cb = {k: b.count(k) for k in keys}
    big = [k for k in keys if ca[k] + cb[k] >= 20]
    cells = [(ca[k], cb[k]) for k in big] + [
        (sum(ca[k] for k in keys if k not in big), sum(cb[k] for k in keys if k not in big))
    ]
    cells = [c for c in cells if sum(c) > 0]
    stat = sum((x - y) ** 2 / (x + y) for x, y in cells)
    return float(torch.special.gammaincc(torch.tensor((len(cells) - 1) / 2), torch.tensor(stat / 2)))


def test_sampled_distribution_is_unchanged_by_speculation(qwen3):
    """top_k 3 makes a tiny vocabulary: the joint law of the first 3 tokens (2 and 3 come from
    verify steps) is the same with random drafts, with and without draft probabilities."""
    prompt = random_prompt(6, 3)
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    N = 1200

    def sample(llm):
        torch.manual_seed(0)
        return [tuple(t) for t in run(llm, [prompt] * N, params)]

    base = sample(make_llm(qwen3, max_num_seqs=32))
    cands = {t for s in base for t in s}
    for with_probs in (False, True):
        llm = make_llm(qwen3, max_num_seqs=32, speculative_config=ngram(2), adaptive_spec=False)
        llm.engine.parts.spec.proposer = RandomDrafts(cands, with_probs)
        spec = sample(llm)
        stats = llm.engine.stats()
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
        assert two_sample_pvalue(base, spec) > 1e-3, with_probs


def test_adaptive_k_follows_acceptance(qwen3, long_ref):
    prompts, ref, params = long_ref
    ks = {}
    for label, wrong_every, adaptive in (("right", 10**9, True), ("wrong", 1, True), ("pinned", 1, False)):
        llm = with_oracle(
            make_llm(qwen3, speculative_config=ngram(6, prompt_lookup_max=6), adaptive_spec=adaptive),
            prompts,
            ref,
            wrong_every=wrong_every,
        )
        eng = llm.engine
        eng.add_request("r", {"prompt_token_ids": prompts[3]}, params)
        seen = []
        while eng.has_unfinished_requests():
            req = eng.parts.scheduler.requests.get("r")
            if req is not None and req.spec_state is not None:
                seen.append(req.spec_state.k)
            eng.step()
        ks[label] = seen
    assert ks["right"][0] < 6 and ks["right"][-1] == 6  # starts hopeful, climbs to k_max
    assert ks["wrong"][-1] == 0  # every first draft rejected: drafting stops (probes now and then)
    assert set(ks["pinned"]) == {6}


def test_no_blocks_leak_after_aborts_with_drafts_pending(qwen3):
    llm = make_llm(
        qwen3, speculative_config=ngram(3), kv_cache_memory=kv_gib(qwen3, 40), max_model_len=64, max_num_seqs=6
    )
    eng = llm.engine
    total = eng.parts.kv.num_blocks
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i, p in enumerate(REPEATED):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, params)
    eng.add_request(
        "n",
        {"prompt_token_ids": REPEATED[0]},
        SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=30, ignore_eos=True),
    )
    pending = 0
    for step in range(40):
        eng.step()
        pending += sum(r.draft is not None for r in eng.parts.scheduler.running)
        if step == 8:
            for rid in ("r0", "r3", "n"):
                assert eng.abort_request(rid)
    for rid in list(eng.parents):
        eng.abort_request(rid)
    assert pending > 0 and eng.stats()["spec_num_drafts"] > 0
    assert not eng.has_unfinished_requests() and eng.parts.scheduler.num_unfinished == 0
    assert eng.parts.kv.num_free_blocks == total
