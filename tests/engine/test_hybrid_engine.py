"""Hybrid models (recurrent state beside the paged KV) through the engine: every way a request can be
cut up -- chunked (a 7-token budget), batched, a prefix-cache hit restoring a state snapshot (hit
lengths asserted, multi-turn chat reusing the last turn), preempted, aborted and resubmitted,
speculated (n-gram k = 1..4, drafts of different lengths in one step, drafts that are always wrong)
-- gives the tokens of the plain run, and every state slot comes back."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.config.model_config import ModelConfig
from ember.errors import KVCacheTooSmallError
from ember.spec.proposer import Draft, Proposer
from tests.models.tiny_hybrids import VOCAB
from tests.models.tiny_models import one_thread, random_prompt  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BS = 4


def prompt(n: int, seed: int, repeat: int = 1) -> list[int]:
    return [t % VOCAB for t in random_prompt(n, seed)] * repeat


PROMPTS = [prompt(n, 70 + n) for n in (5, 23, 1, 45, 9, 31)]
REPEATING = [prompt(n, 90 + n, 3) for n in (3, 7, 4, 10)]  # something for prompt lookup to find


def make_llm(path, **kw):
    kw = (
        dict(dtype="float32", block_size=BS, max_model_len=160, num_threads=1, kv_cache_memory=0.004, max_num_seqs=4)
        | kw
    )
    return LLM(path, **kw)


def run(llm, prompts, params=GREEDY):
    return [
        o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ]


def assert_all_returned(llm):
    eng = llm.engine
    states = eng.parts.kv.states
    assert states.num_free == states.num_live
    assert len(states.free_snap) + len(states.named) == states.num_snapshots  # no snapshot slot leaked
    assert eng.parts.kv.num_free_blocks == eng.parts.kv.num_blocks


@pytest.fixture(scope="module")
def qwen3_next(tiny_hybrid_dir):
    return tiny_hybrid_dir("qwen3_next")


@pytest.fixture(scope="module")
def plain(qwen3_next):
    """The reference: one request at a time, no prefix cache, no chunking."""
    llm = make_llm(qwen3_next, enable_prefix_caching=False, max_num_seqs=1)
    return {tuple(p): run(llm, [p])[0] for p in PROMPTS + REPEATING}


@pytest.mark.parametrize(
    "knobs",
    [
        dict(max_num_batched_tokens=7),  # every prompt in chunks of <= 7, mixed with decodes
        dict(),  # batched
        dict(max_num_seqs=2, max_num_batched_tokens=11, enable_prefix_caching=False),
    ],
    ids=["chunked", "batched", "chunked-no-prefix-cache"],
)
def test_chunked_and_batched_equal_the_plain_run(qwen3_next, plain, knobs):
    llm = make_llm(qwen3_next, **knobs)
    assert run(llm, PROMPTS) == [plain[tuple(p)] for p in PROMPTS]
    assert_all_returned(llm)


def test_prefix_hits_restore_the_state_and_say_how_many_tokens(qwen3_next, plain):
    llm = make_llm(qwen3_next)
    a = PROMPTS[3]  # 45 tokens: the last block boundary before its end is 44
    first = llm.generate([{"prompt_token_ids": a}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": a}], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 44 and again.outputs[0].token_ids == plain[tuple(a)]
    longer = a + prompt(12, 5)
    out = llm.generate([{"prompt_token_ids": longer}], GREEDY, use_tqdm=False)[0]
    ref = make_llm(qwen3_next, enable_prefix_caching=False, max_num_seqs=1)
    assert out.num_cached_tokens == 44 and out.outputs[0].token_ids == run(ref, [longer])[0]
    # the next chat turn: the previous prompt and answer, then new tokens. The answer's 20 tokens
    # were computed up to position 45 + 19 = 64, a block boundary: that is where the turn resumes.
    turn2 = a + plain[tuple(a)] + prompt(6, 8)
    out = llm.generate([{"prompt_token_ids": turn2}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and out.outputs[0].token_ids == run(ref, [turn2])[0]
    assert_all_returned(llm)


def test_without_snapshots_a_hit_never_skips_tokens(qwen3_next, plain):
    llm = make_llm(qwen3_next, max_state_snapshots=0)
    a = PROMPTS[3]
    run(llm, [a])
    out = llm.generate([{"prompt_token_ids": a}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == plain[tuple(a)]


def test_preempted_requests_restart_and_give_the_same_tokens(qwen3_next, plain):
    mc = ModelConfig.from_folder(qwen3_next)
    states = mc.state_bytes_per_seq(4) * (4 + 8)  # max_num_seqs live slots + 2 x as many snapshots (the default)
    kv = 30 * BS * mc.kv_bytes_per_token_per_dtype_byte * 4  # 30 blocks: not enough for four at once
    llm = make_llm(qwen3_next, kv_cache_memory=(states + kv) / 2**30, max_model_len=80)
    assert run(llm, PROMPTS) == [plain[tuple(p)] for p in PROMPTS]
    assert llm.engine.parts.scheduler.num_preemptions > 0
    assert_all_returned(llm)


def test_aborted_then_resubmitted(qwen3_next, plain):
    llm = make_llm(qwen3_next, max_num_batched_tokens=9)
    eng = llm.engine
    for i, p in enumerate(PROMPTS[:4]):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    for _ in range(6):
        eng.step()
    assert eng.parts.kv.states.num_free < eng.parts.kv.states.num_live
    for i in range(4):
        eng.abort_request(f"r{i}")
    assert_all_returned(llm)
    assert run(llm, PROMPTS[:4]) == [plain[tuple(p)] for p in PROMPTS[:4]]
    assert_all_returned(llm)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_ngram_speculation_equals_the_plain_run(qwen3_next, plain, k):
    llm = make_llm(
        qwen3_next,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": k,
            "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
        },
        max_num_batched_tokens=13,
    )
    assert run(llm, REPEATING) == [plain[tuple(p)] for p in REPEATING]
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert_all_returned(llm)


class Scripted(Proposer):
    """Drafts from the known greedy continuation, `wrong` at chosen positions, a different length
    for each request (1..4): accepted runs, rejections at every position, bonus tokens."""

    num_speculative_tokens = 4

    def __init__(self, truth, always_wrong=False):
        self.truth, self.always_wrong = truth, always_wrong

    def propose(self, requests, ks):
        drafts = []
        for req, k in zip(requests, ks):
            n = req.num_tokens
            k = min(k, 1 + hash((req.request_id, n)) % 4)
            guess = self.truth.get(tuple(req.prompt_token_ids), [])[n : n + k]
            guess = [(t + 1) % VOCAB if self.always_wrong or (n + j) % 3 == 0 else t for j, t in enumerate(guess)]
            drafts.append(Draft(guess) if guess else None)
        return drafts


@pytest.mark.parametrize("always_wrong", [False, True])
def test_verify_rolls_the_state_back_to_the_accepted_token(qwen3_next, plain, always_wrong):
    llm = make_llm(qwen3_next, speculative_config={"method": "ngram", "num_speculative_tokens": 4}, adaptive_spec=False)
    truth = {tuple(p): p + plain[tuple(p)] for p in PROMPTS}
    llm.engine.parts.spec.proposer = Scripted(truth, always_wrong)
    assert run(llm, PROMPTS) == [plain[tuple(p)] for p in PROMPTS]
    stats = llm.engine.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert (stats["spec_num_accepted_tokens"] == 0) == always_wrong
    assert_all_returned(llm)


def test_verified_tokens_are_snapshotted_only_once_accepted(qwen3_next, plain):
    """Speculation with prefix caching: the next turn resumes from a snapshot a verify step wrote,
    and its tokens equal the plain run's (a snapshot of a rejected draft would change them)."""
    llm = make_llm(
        qwen3_next,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
        adaptive_spec=False,
        max_num_batched_tokens=7,
    )
    truth = {tuple(p): p + plain[tuple(p)] for p in PROMPTS}
    llm.engine.parts.spec.proposer = Scripted(truth)
    a = PROMPTS[1]
    assert run(llm, [a]) == [plain[tuple(a)]]
    turn2 = a + plain[tuple(a)] + prompt(5, 3)
    ref = run(make_llm(qwen3_next, enable_prefix_caching=False, max_num_seqs=1), [turn2])[0]
    out = llm.generate([{"prompt_token_ids": turn2}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref and out.num_cached_tokens > 20
    assert_all_returned(llm)


def test_a_state_budget_too_small_names_the_flags(qwen3_next):
    mc = ModelConfig.from_folder(qwen3_next)
    too_small = mc.state_bytes_per_seq(4) * 4 / 2**30  # not even the live slots and snapshots
    with pytest.raises(KVCacheTooSmallError, match="--max-num-seqs.*--max-state-snapshots"):
        make_llm(qwen3_next, kv_cache_memory=too_small)


@pytest.fixture(scope="module")
def qwen3_next_mtp(tmp_path_factory):
    from tests.models.tiny_hybrids import add_mtp, build_hybrid, save_hybrid

    hf = build_hybrid("qwen3_next")
    return add_mtp(hf, save_hybrid(hf, str(tmp_path_factory.mktemp("qwen3-next-mtp"))))


@pytest.mark.parametrize("k", [1, 3])
def test_native_mtp_speculation_equals_the_plain_run(qwen3_next_mtp, plain, k):
    """The model's own mtp.* layer (gated attention + MoE with a shared expert) drafts; the target's
    greedy tokens do not change (the same weights as `plain`: transformers ignores mtp.*)."""
    llm = make_llm(
        qwen3_next_mtp, speculative_config={"method": "mtp", "num_speculative_tokens": k}, adaptive_spec=False
    )
    assert run(llm, PROMPTS) == [plain[tuple(p)] for p in PROMPTS]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_returned(llm)


def test_mtp_with_prefix_caching_and_chunked_prefill_together(qwen3_next_mtp, plain):
    llm = make_llm(
        qwen3_next_mtp,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        adaptive_spec=False,
        max_num_batched_tokens=9,
    )
    a = PROMPTS[3]
    assert run(llm, [a, PROMPTS[1]]) == [plain[tuple(a)], plain[tuple(PROMPTS[1])]]
    out = llm.generate([{"prompt_token_ids": a}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 44 and out.outputs[0].token_ids == plain[tuple(a)]
    turn2 = a + plain[tuple(a)] + prompt(6, 8)
    ref = run(make_llm(llm_path := qwen3_next_mtp, enable_prefix_caching=False, max_num_seqs=1), [turn2])[0]
    out = llm.generate([{"prompt_token_ids": turn2}], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref and out.num_cached_tokens >= 44, llm_path
    assert_all_returned(llm)


def test_fp8_kv_quantizes_the_attention_layers_only(qwen3_next, plain):
    llm = make_llm(qwen3_next, kv_cache_dtype="fp8")
    runner = llm.engine.parts.runner
    kinds = {type(c).__name__ if not hasattr(c, "dtype") else str(c.dtype) for c in runner.kv_caches}
    assert kinds == {"RecurrentState", "torch.float8_e4m3fn"}
    assert all(st.ssm.dtype == torch.float32 and st.conv.dtype == torch.float32 for st in runner.recurrent_states)
    out = run(llm, PROMPTS)
    same = sum(a == b for o, p in zip(out, PROMPTS) for a, b in zip(o, plain[tuple(p)]))
    assert same >= 0.8 * sum(len(o) for o in out)  # fp8 keys and values: close to the plain run, not equal
    assert_all_returned(llm)


@pytest.fixture(scope="module")
def dense_draft(tmp_path_factory):
    """A tiny dense Qwen3 with the hybrids' vocabulary: a draft model for a hybrid target."""
    import transformers

    from tests.models.tiny_hybrids import save_hybrid

    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=512,
    )
    torch.manual_seed(11)
    return save_hybrid(transformers.Qwen3ForCausalLM(cfg).eval(), str(tmp_path_factory.mktemp("draft")))


def test_a_draft_model_speculates_for_a_hybrid_target(qwen3_next, dense_draft, plain):
    llm = make_llm(
        qwen3_next,
        speculative_config={"method": "draft", "model": dense_draft, "num_speculative_tokens": 3},
        max_num_batched_tokens=13,
    )
    assert run(llm, PROMPTS) == [plain[tuple(p)] for p in PROMPTS]
    assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    assert_all_returned(llm)


def test_a_hybrid_draft_model_is_refused_by_name(qwen3_next):
    from ember.errors import ConfigError

    with pytest.raises(ConfigError, match="hybrid.*dense draft"):
        make_llm(qwen3_next, speculative_config={"method": "draft", "model": qwen3_next, "num_speculative_tokens": 2})


def test_a_model_of_linear_layers_only_needs_no_kv(tmp_path):
    """No attention layer: KV blocks cost nothing (bookkeeping only); chunked with prefix hits equals
    the plain run (transformers itself cannot run such a model: its mask needs an attention layer)."""
    from tests.models.tiny_hybrids import build_hybrid, save_hybrid

    path = save_hybrid(
        build_hybrid(
            "qwen3_5", layer_types=["linear_attention"] * 3, num_hidden_layers=3, full_attention_interval=None
        ),
        str(tmp_path / "linear-only"),
    )
    ref = run(make_llm(path, enable_prefix_caching=False, max_num_seqs=1), PROMPTS)
    llm = make_llm(path, max_num_batched_tokens=7, max_state_snapshots=24)  # room for every prompt's snapshot
    caches = llm.engine.parts.runner.kv_caches
    assert caches and not [c for c in caches if isinstance(c, torch.Tensor)]
    assert run(llm, PROMPTS) == ref and run(llm, PROMPTS) == ref
    assert llm.engine.parts.kv.stats.hits > 0
    assert_all_returned(llm)


class RandomDrafts(Proposer):
    """Random guesses among a few tokens, with (q uniform over them) or without draft probabilities."""

    num_speculative_tokens = 2

    def __init__(self, candidates, with_probs):
        self.cands, self.with_probs = sorted(candidates), with_probs
        self.gen = torch.Generator().manual_seed(0)

    def propose(self, requests, ks):
        q = torch.zeros(VOCAB)
        q[self.cands] = 1.0 / len(self.cands)
        out = []
        for k in ks:
            toks = [self.cands[i] for i in torch.randint(len(self.cands), (k,), generator=self.gen).tolist()]
            out.append(Draft(toks, q.expand(k, VOCAB).clone() if self.with_probs else None))
        return out


def test_sampling_keeps_the_target_distribution_under_speculation(qwen3_next):
    """The joint law of the first 3 sampled tokens (2 and 3 from verify steps that roll the state
    back on rejection) is the same with random drafts as without speculation (chi-square)."""
    from tests.spec.test_spec_engine import two_sample_pvalue

    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    N = 800

    def sample(llm):
        torch.manual_seed(0)
        return [tuple(t) for t in run(llm, [PROMPTS[0]] * N, params)]

    base = sample(make_llm(qwen3_next, max_num_seqs=32, kv_cache_memory=0.02))
    cands = {t for s in base for t in s}
    for with_probs in (False, True):
        llm = make_llm(
            qwen3_next,
            max_num_seqs=32,
            kv_cache_memory=0.02,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            adaptive_spec=False,
        )
        llm.engine.parts.spec.proposer = RandomDrafts(cands, with_probs)
        spec = sample(llm)
        stats = llm.engine.stats()
        assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
        assert two_sample_pvalue(base, spec) > 1e-3, with_probs
        assert_all_returned(llm)
