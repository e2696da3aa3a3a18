"""Rejection sampling: greedy verify equals token-by-token greedy sampling; sampled verify emits
tokens distributed exactly as the target (chi-square on a tiny vocabulary); seeds reproduce."""

from __future__ import annotations

import pytest
import torch

from ember.layers.sampler import Sampler, SamplingRow, make_generator
from ember.sampling import SamplingParams
from ember.spec.proposer import Draft
from ember.spec.rejection import RejectionSampler, VerifyRequest

GREEDY = SamplingParams(temperature=0)


def verify_request(params, drafts, probs=None, gen=None, prompt=(1, 2), output=(), banned=None):
    rows = [SamplingRow(params, list(prompt), list(output) + drafts[:j], gen, banned) for j in range(len(drafts) + 1)]
    return VerifyRequest(rows, Draft(drafts, probs))


def emitted(logits, reqs):
    return [[t.token_id for t in toks] for toks in RejectionSampler()(logits, reqs)]


def test_greedy_accepts_matches_then_the_argmax_or_the_bonus():
    logits = torch.full((4, 10), -1.0)
    for row, tok in enumerate([5, 7, 2, 9]):
        logits[row, tok] = 3.0
    assert emitted(logits, [verify_request(GREEDY, [5, 7, 3])]) == [[5, 7, 2]]  # third rejected: its argmax
    assert emitted(logits, [verify_request(GREEDY, [5, 7, 2])]) == [[5, 7, 2, 9]]  # all accepted: bonus
    assert emitted(logits, [verify_request(GREEDY, [1, 7, 2])]) == [[5]]  # first rejected
    # Two requests in one batch, rows consecutive.
    both = torch.cat([logits[:2], logits])
    assert emitted(both, [verify_request(GREEDY, [5]), verify_request(GREEDY, [5, 0, 2])]) == [[5, 7], [5, 7]]


def sequential(logits, params, drafts, prompt, banned):
    """What plain decoding emits, one sampler call per token, stopping at the first draft it disagrees with."""
    out = []
    for j in range(len(drafts) + 1):
        tok = Sampler()(logits[j : j + 1], [SamplingRow(params, prompt, out[:], None, banned)])[0].token_id
        out.append(tok)
        if j == len(drafts) or tok != drafts[j]:
            return out


def test_greedy_verify_sees_each_rows_own_history():
    """Penalties and min_tokens bans of row j count the drafts before it: same tokens as plain decoding."""
    g = torch.Generator().manual_seed(0)
    prompt = [3, 4]
    cases = [
        SamplingParams(temperature=0, repetition_penalty=1.8),
        SamplingParams(temperature=0, frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6]),
    ]
    for params in cases:
        for trial in range(20):
            logits = torch.randn(4, 8, generator=g)
            logits[:, 6] += 2.0  # the stop token is often the argmax: the ban matters
            truth = sequential(logits, params, [0, 0, 0], prompt, [7])
            # Drafts that agree with plain decoding up to a point, then one that may not.
            drafts = (truth + [1, 1, 1])[:3]
            if trial % 2:
                drafts[trial % 3] = (drafts[trial % 3] + 1) % 8
            want = sequential(logits, params, drafts, prompt, [7])
            got = emitted(logits, [verify_request(params, drafts, prompt=prompt, banned=[7])])[0]
            assert got == want, (params, drafts)


def test_repetition_penalty_flips_the_second_row():
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]] * 2)
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    # Row 1's history holds draft 0 (token 0): 2.0 / 1.5 < 1.9, so token 1 wins there.
    assert emitted(logits, [verify_request(params, [0], prompt=[3])]) == [[0, 1]]


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was emitted"
    n = counts.sum()
    expected = probs[keep] * n
    stat = ((counts[keep] - expected) ** 2 / expected).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2), stat / 2))


V, TRIALS = 6, 12000
TARGET = torch.tensor(
    [[1.0, 0.2, -0.5, 2.0, 0.0, -1.0], [0.0, 1.5, 1.4, -2.0, 0.3, 0.9], [0.5, 0.5, 0.5, 0.5, 0.5, -3.0]]
)


def _run(params, with_probs: bool, seed: int):
    """TRIALS requests with 2 random drafts each over fixed target rows; returns emitted tokens
    and the target distributions the sampler should reproduce."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)  # the draft's own (wrong) distributions
    # Drafts drawn from q; without probs the sampler treats each as a deterministic guess (q
    # one-hot), which is exact for any way of choosing it (formats.md section 5).
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=g).T.tolist()
    reqs = [verify_request(params, x, probs=q.clone() if with_probs else None) for x in drafts]
    logits = TARGET.repeat(TRIALS, 1)
    from ember.layers.sampler import target_probs

    p = target_probs(TARGET.clone(), [params] * 3)
    return emitted(logits, reqs), p, q


@pytest.mark.slow
def test_sampled_tokens_follow_the_target_exactly():
    """Position 1 is always emitted and ~p_1; position 2, when emitted, is ~p_2 (lossless)."""
    for params in (SamplingParams(temperature=0.9), SamplingParams(temperature=1.3, top_k=4, top_p=0.9)):
        for with_probs in (False, True):
            out, p, q = _run(params, with_probs, seed=11)
            first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).double()
            second = torch.bincount(torch.tensor([o[1] for o in out if len(o) > 1]), minlength=V).double()
            assert chi2_pvalue(first, p[0].double()) > 1e-3, (params, with_probs, first, p[0])
            assert chi2_pvalue(second, p[1].double()) > 1e-3, (params, with_probs, second, p[1])
            # Acceptance at position 1: sum(min(p, q)) with draft probs, sum(q p) for one-hot guesses.
            alpha = float(torch.minimum(p[0], q[0]).sum() if with_probs else (p[0] * q[0]).sum())
            rate = sum(len(o) > 1 for o in out) / TRIALS
            assert abs(rate - alpha) < 4 * (alpha * (1 - alpha) / TRIALS) ** 0.5 + 1e-3, (rate, alpha)


def test_zero_draft_probability_rejects():
    params = SamplingParams(temperature=1.0)
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    logits = torch.zeros(2, 4)
    for _ in range(20):
        out = emitted(logits, [verify_request(params, [0], probs=q)])[0]
        assert len(out) == 1 and out[0] != 1  # residual max(p - q, 0) excludes token 1


def test_seeded_verify_is_reproducible_and_draws_only_its_own_generator():
    params = SamplingParams(temperature=1.0, seed=5)
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    runs = []
    for _ in range(2):
        gen = make_generator(5)
        torch.manual_seed(len(runs))  # the global RNG differs between runs: must not matter
        other = verify_request(SamplingParams(temperature=1.0), [1])  # an unseeded neighbour
        runs.append(
            [
                emitted(torch.cat([logits, logits[:2]]), [verify_request(params, [7, 8, 9], gen=gen), other])[0]
                for _ in range(10)
            ]
        )
    assert runs[0] == runs[1]
    # The draws are d uniforms then one noise vector of V: the generator advanced by exactly that.
    gen, ref = make_generator(5), make_generator(5)
    emitted(logits, [verify_request(params, [7, 8, 9], gen=gen)])
    torch.rand(3, generator=ref)
    torch.empty(50).uniform_(generator=ref)
    assert torch.equal(gen.get_state(), ref.get_state())


def test_logprobs_are_from_each_emitted_tokens_row():
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(1))
    a, b = logits[0].argmax().item(), logits[1].argmax().item()
    toks = RejectionSampler()(logits, [verify_request(SamplingParams(temperature=0, logprobs=2), [a, (b + 1) % 12])])[0]
    assert [t.token_id for t in toks] == [a, b]
    for row, t in enumerate(toks):
        ref = torch.log_softmax(logits[row], -1)
        assert t.logprobs[t.token_id].logprob == ref[t.token_id].item() and t.logprobs[t.token_id].rank == 1
        assert set(ref.topk(2).indices.tolist()) <= set(t.logprobs)
