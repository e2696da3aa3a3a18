import math

import pytest
import torch

from ember.layers.sampler import SampledToken, Sampler, SamplingRow, _apply_penalties, make_generator
from ember.sampling import SamplingParams

sampler = Sampler()


def row(prompt=(), output=(), seed=None, banned=None, **kw) -> SamplingRow:
    params = SamplingParams(seed=seed, **kw)
    gen = make_generator(seed) if seed is not None else None
    return SamplingRow(params, list(prompt), list(output), gen, banned)


def tokens(logits, rows) -> list[int]:
    return [s.token_id for s in sampler(logits, rows)]


# -- greedy -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(dtype):
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = [row(temperature=0.0) for _ in range(8)]
    out = sampler(logits, rows)
    assert all(isinstance(s, SampledToken) and s.logprobs is None for s in out)
    assert [s.token_id for s in out] == logits.argmax(-1).tolist()


def test_greedy_ignores_filters_and_mixes_with_random_rows():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=0.0, top_k=5, top_p=0.5) if i % 2 == 0 else row(temperature=1.0, seed=i) for i in range(6)]
    out = tokens(logits, rows)
    assert out[0::2] == logits[0::2].argmax(-1).tolist()


def test_sampler_never_modifies_caller_logits():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    rows = [
        row(output=[1, 2, 2], repetition_penalty=1.5, frequency_penalty=0.5, temperature=0.0),
        row(seed=1, top_k=3, top_p=0.8, min_p=0.1, temperature=0.7),
        row(output=[], min_tokens=2, banned=[int(logits[2].argmax())], temperature=0.0),
        row(seed=2, logprobs=5),
    ]
    sampler(logits, rows)
    assert torch.equal(logits, before)


# -- seeded reproducibility -------------------------------------------------------------

V = 1000


def _seeded_run(seed, params, neighbours, position, steps=20):
    """Tokens of one seeded request over `steps` steps, inside a batch built by neighbours."""
    g_logits = torch.Generator().manual_seed(99)  # the request's own logits per step
    g_other = torch.Generator().manual_seed(position * 31 + len(neighbours))
    me = row(seed=seed, **params)
    others = [row(seed=s, **kw) for s, kw in neighbours]
    out = []
    for _ in range(steps):
        mine = torch.randn(V, generator=g_logits) * 2.0
        batch = [torch.randn(V, generator=g_other) * 3.0 for _ in others]
        batch.insert(position, mine)
        rows = others[:position] + [me] + others[position:]
        t = tokens(torch.stack(batch), rows)
        out.append(t[position])
        me.output_token_ids.append(t[position])
        for i, r in enumerate(rows):
            if r is not me:
                r.output_token_ids.append(t[i])
    return out


NEIGHBOURS = [
    [],
    [(None, {})],
    [(None, {"temperature": 0.0}), (7, {"top_p": 0.5}), (None, {"top_k": 10})],
    [(None, {"min_p": 0.2}), (8, {})] * 4 + [(None, {"repetition_penalty": 1.3, "logprobs": 3})],
]


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1.0},
        {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "min_p": 0.01},
        {"temperature": 1.2, "top_k": 20, "frequency_penalty": 0.5, "logprobs": 2},
    ],
)
def test_same_seed_same_tokens_whatever_the_batch(params):
    runs = []
    for n_i, neighbours in enumerate(NEIGHBOURS):
        for position in sorted({0, len(neighbours) // 2, len(neighbours)}):
            runs.append(_seeded_run(1234, params, neighbours, position))
    assert all(r == runs[0] for r in runs[1:])
    assert len(set(runs[0])) > 5  # really sampling, not stuck on one token


def test_different_seeds_differ():
    params = {"temperature": 1.0}
    a = _seeded_run(1, params, [], 0)
    b = _seeded_run(2, params, [], 0)
    assert a != b
    assert _seeded_run(1, params, [], 0) == a


def test_unseeded_rows_follow_torch_default_generator():
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    rows = [row() for _ in range(3)]
    torch.manual_seed(5)
    a = tokens(logits, rows)
    torch.manual_seed(5)
    assert tokens(logits, rows) == a


# -- statistical support tests ------------------------------------------------------------

PROBS = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.08, 0.05, 0.02])
N = 2000


def _frequencies(params_per_row, seed=0):
    """Sample N times from PROBS (one batched call of N rows); return per-row-group freqs."""
    logits = PROBS.log().expand(N, -1).contiguous()
    rows = [row(**params_per_row(i)) for i in range(N)]
    torch.manual_seed(seed)
    return torch.tensor(tokens(logits, rows))


def _assert_matches(samples, expected, tol=0.035):
    allowed = set(torch.nonzero(expected).flatten().tolist())
    assert set(samples.tolist()) <= allowed
    freq = torch.bincount(samples, minlength=len(expected)).float() / len(samples)
    assert torch.allclose(freq, expected, atol=tol), (freq, expected)


def _renorm(keep):
    p = PROBS.clone()
    p[[i for i in range(len(p)) if i not in keep]] = 0
    return p / p.sum()


def test_plain_sampling_matches_distribution():
    _assert_matches(_frequencies(lambda i: {}), PROBS)


def test_temperature_sharpens():
    sharp = PROBS**2 / (PROBS**2).sum()
    _assert_matches(_frequencies(lambda i: {"temperature": 0.5}), sharp)


def test_top_k_restricts_support():
    _assert_matches(_frequencies(lambda i: {"top_k": 3}), _renorm({0, 1, 2}))


def test_top_p_restricts_support():
    # cumulative 0.30, 0.50, 0.65: the smallest set reaching 0.6 is the first three.
    _assert_matches(_frequencies(lambda i: {"top_p": 0.6}), _renorm({0, 1, 2}))
    # a top_p below the top token's mass still keeps the top token.
    assert set(_frequencies(lambda i: {"top_p": 0.1}).tolist()) == {0}


def test_min_p_restricts_support():
    # min_p * max = 0.09: tokens with prob >= 0.09 survive.
    _assert_matches(_frequencies(lambda i: {"min_p": 0.3}), _renorm({0, 1, 2, 3, 4}))


def test_per_row_filters_in_one_batch():
    """Rows with different top_k / top_p / min_p / seeds share one vectorised call."""
    kinds = [{"top_k": 2}, {"top_p": 0.6}, {"min_p": 0.3}, {}]
    samples = _frequencies(lambda i: kinds[i % 4])
    expected = [_renorm({0, 1}), _renorm({0, 1, 2}), _renorm({0, 1, 2, 3, 4}), PROBS]
    for k, exp in enumerate(expected):
        _assert_matches(samples[k::4], exp, tol=0.05)


def test_top_k_and_top_p_together():
    # top_k=4 then top_p on the renormalised four: 0.4, 0.667, ... -> first two reach 0.6.
    _assert_matches(_frequencies(lambda i: {"top_k": 4, "top_p": 0.6}), _renorm({0, 1}))


def test_top_k_larger_than_vocab_is_off():
    _assert_matches(_frequencies(lambda i: {"top_k": 100}), PROBS)


# -- penalties ----------------------------------------------------------------------------


def _penalised(logits, rows):
    work = logits.clone()
    _apply_penalties(work, rows, list(range(len(rows))))
    return work


def test_repetition_penalty_values():
    logits = torch.tensor([[2.0, -1.0, 3.0, 0.5, 1.0]])
    r = row(prompt=[0], output=[1, 1], repetition_penalty=2.0)
    out = _penalised(logits, [r])
    # prompt and output tokens both count; positive / 2, negative * 2; others untouched.
    assert torch.allclose(out, torch.tensor([[1.0, -2.0, 3.0, 0.5, 1.0]]))


def test_repetition_penalty_lowers_probability_of_seen_tokens():
    logits = PROBS.log().expand(N, -1).contiguous()
    rows = [row(output=[0], repetition_penalty=1.5) for _ in range(N)]
    torch.manual_seed(0)
    freq0 = (torch.tensor(tokens(logits, rows)) == 0).float().mean()
    assert freq0 < PROBS[0] - 0.05
    # greedy: the top token, once seen, loses to the runner-up
    logits = torch.tensor([[2.0, 1.8, 0.1]])
    assert tokens(logits, [row(temperature=0, output=[0], repetition_penalty=1.2)]) == [1]
    assert tokens(logits, [row(temperature=0, output=[2], repetition_penalty=1.2)]) == [0]


def test_frequency_scales_with_count_presence_does_not():
    logits = torch.zeros(1, 6)
    out = [4, 4, 4, 5]
    freq = _penalised(logits, [row(prompt=[0, 1], output=out, frequency_penalty=0.5)])
    assert torch.allclose(freq, torch.tensor([[0, 0, 0, 0, -1.5, -0.5]]))
    pres = _penalised(logits, [row(prompt=[0, 1], output=out, presence_penalty=0.5)])
    assert torch.allclose(pres, torch.tensor([[0, 0, 0, 0, -0.5, -0.5]]))
    both = _penalised(logits, [row(output=out, presence_penalty=-1.0, frequency_penalty=1.0)])
    assert torch.allclose(both, torch.tensor([[0, 0, 0, 0, -2.0, 0.0]]))


def test_penalties_per_row_in_a_mixed_batch():
    logits = torch.zeros(3, 4)
    rows = [row(output=[1]), row(output=[1, 1], frequency_penalty=1.0), row(output=[2])]
    work = logits.clone()
    _apply_penalties(work, rows, [1])
    assert torch.equal(work[0], torch.zeros(4)) and torch.equal(work[2], torch.zeros(4))
    assert torch.allclose(work[1], torch.tensor([0.0, -2.0, 0.0, 0.0]))
    # through the sampler: greedy picks the unpenalised token
    logits = torch.tensor([[1.0, 0.9], [1.0, 0.9]])
    rows = [row(temperature=0, output=[0]), row(temperature=0, output=[0], presence_penalty=0.2)]
    assert tokens(logits, rows) == [0, 1]


# -- min_tokens -----------------------------------------------------------------------------


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    eos = 3
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 5.0]])
    early = row(temperature=0, output=[1], min_tokens=3, banned=[eos], stop_token_ids=[4])
    assert tokens(logits, [early]) == [2]
    done = row(temperature=0, output=[1, 1, 1], min_tokens=3, banned=[eos], stop_token_ids=[4])
    assert tokens(logits, [done]) == [eos]
    # random rows never draw a banned id either
    logits = torch.zeros(N, 5)
    rows = [row(min_tokens=1, banned=[0, 1], stop_token_ids=[2]) for _ in range(N)]
    torch.manual_seed(0)
    assert set(tokens(logits, rows)) == {3, 4}


# -- logprobs -------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits_with_ranks():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 200, generator=g)
    rows = [
        row(
            temperature=0, logprobs=5, output=[int(logits[0].argmax())], repetition_penalty=10.0
        ),  # sampled token is not the raw argmax
        row(seed=3, temperature=2.0, top_k=50, logprobs=0),
        row(seed=4, logprobs=20, presence_penalty=1.0, output=[1, 2]),
    ]
    out = sampler(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i, (s, r) in enumerate(zip(out, rows)):
        lp = s.logprobs
        n = r.params.logprobs
        top = raw[i].topk(n).indices.tolist() if n else []
        assert set(lp) == set(top) | {s.token_id}
        assert next(iter(lp)) == s.token_id  # sampled token first
        for tid, entry in lp.items():
            assert math.isclose(entry.logprob, raw[i, tid].item(), rel_tol=1e-6, abs_tol=1e-6)
            assert entry.rank == 1 + int((raw[i] > raw[i, tid]).sum())
            assert entry.decoded_token is None
    assert out[0].token_id != int(logits[0].argmax())
    assert out[0].logprobs[out[0].token_id].rank > 1
    assert [out[0].logprobs[t].rank for t in raw[0].topk(5).indices.tolist()] == [1, 2, 3, 4, 5]


def test_logprobs_ranks_with_ties_and_bf16():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]], dtype=torch.bfloat16)
    s = sampler(logits, [row(temperature=0, logprobs=4)])[0]
    ranks = {t: e.rank for t, e in s.logprobs.items()}
    assert ranks == {1: 1, 2: 1, 3: 3, 0: 4}
    assert s.token_id in (1, 2)
    expected = torch.log_softmax(logits.float(), -1)[0, 3].item()
    assert math.isclose(s.logprobs[3].logprob, expected, rel_tol=1e-6)


def test_rows_without_logprobs_get_none():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(6))
    out = sampler(logits, [row(logprobs=2, seed=1), row(seed=2)])
    assert out[0].logprobs is not None and out[1].logprobs is None


def test_shape_mismatch_is_an_error():
    with pytest.raises(ValueError):
        sampler(torch.zeros(2, 5), [row()])


def test_make_generator_accepts_any_int_seed():
    for seed in (0, -1, 2**70):
        a = torch.rand(3, generator=make_generator(seed))
        b = torch.rand(3, generator=make_generator(seed))
        assert torch.equal(a, b)


# -- filters against a plain reference --------------------------------------------------------


def _reference_keep(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Which tokens survive, computed one token at a time the textbook way."""
    probs = torch.softmax(logits.double() / p.temperature, -1)
    order = sorted(range(len(probs)), key=lambda i: -probs[i].item())
    keep = [i for i in order if probs[i] >= p.min_p * probs[order[0]]]
    if p.top_k:
        keep = keep[: p.top_k]
    if p.top_p < 1.0:
        mass = sum(probs[i].item() for i in keep)
        out, acc = [], 0.0
        for i in keep:
            out.append(i)
            acc += probs[i].item() / mass
            if acc >= p.top_p:
                break
        keep = out
    return set(keep)


@pytest.mark.parametrize("scale", [4.0, 0.05])  # peaked: candidate path; flat: full sort
def test_filters_match_reference(scale):
    from ember.layers.sampler import TOP_P_CANDIDATES, apply_filters

    V = 3 * TOP_P_CANDIDATES
    g = torch.Generator().manual_seed(11)
    kinds = [
        dict(top_p=0.9),
        dict(top_k=40, top_p=0.8),
        dict(top_k=7),
        dict(),
        dict(min_p=0.05, top_p=0.95, temperature=0.7),
        dict(top_p=0.5, top_k=2000),
        dict(min_p=0.2),
    ]
    params = [SamplingParams(**kw) for kw in kinds]
    logits = torch.randn(len(params), V, generator=g) * scale
    out = apply_filters(logits, params)
    for i, p in enumerate(params):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == _reference_keep(logits[i], p), kinds[i]
        kept_t = sorted(kept)
        assert torch.allclose(out[i, kept_t], logits[i, kept_t] / p.temperature)


def test_logit_bias_adds_to_the_logits_of_its_row_only():
    from ember.errors import InvalidRequestError
    from ember.layers.sampler import process_logits

    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    biased = SamplingParams(temperature=0, logit_bias={7: 10.0, 3: -100.0})
    rows = [SamplingRow(biased, [1], []), SamplingRow(SamplingParams(temperature=0), [1], [])]
    assert [t.token_id for t in Sampler()(logits, rows)] == [7, 3]
    work = process_logits(logits, rows)
    assert work[0, 7] == 10.0 and work[0, 3] == -95.0 and torch.equal(work[1], logits[1])
    assert SamplingParams(logit_bias={"5": 1}).logit_bias == {5: 1}
    with pytest.raises(InvalidRequestError):
        SamplingParams(logit_bias={5: 101})
