"""Adaptive k: the k that maximises expected tokens per unit of step cost, from a request's decayed
position-1 acceptance, the drafter's depth profile and the measured cost of each verify length."""

from ember.request import Request
from ember.sampling import SamplingParams
from ember.spec.adaptive import AdaptiveK, best_k, expected_tokens


def test_best_k_grows_with_acceptance_and_cheapness():
    assert [best_k(a, 8) for a in (0.0, 0.3, 0.5, 0.6, 0.8, 0.9, 0.95, 1.0)] == [1, 1, 1, 2, 3, 6, 8, 8]
    assert best_k(0.8, 8, cost=0.05) > best_k(0.8, 8) > best_k(0.8, 8, cost=1.0)
    assert best_k(0.99, 3) == 3  # bounded by k_max


def test_k_follows_a_request_acceptance():
    ak = AdaptiveK(k_max=6)
    good, bad = Request("g", [1], None), Request("b", [1], None)
    k0 = ak.k_for(good)
    assert 1 < k0 < 6  # hopeful start, not the maximum
    for _ in range(8):
        ak.observe(good, ak.k_for(good), ak.k_for(good))  # everything accepted
        ak.observe(bad, ak.k_for(bad), 0)  # the first draft rejected every time
    assert ak.k_for(good) == 6 and ak.k_for(bad) == 0  # nothing accepted: drafting costs more than it brings
    for _ in range(8):  # the text turned into prose: good's acceptance falls, k follows
        ak.observe(good, ak.k_for(good), 1)
        ak.observe(good, ak.k_for(good), 0)
    assert ak.k_for(good) <= 2
    # The request counts its position-1 outcome; the drafter's profile counts positions 1..3 (a
    # rejection ends a step's trials: position 4 was never tried).
    r = Request("r", [1], None)
    s = ak.state(r)
    acc, tri = s.accepted, s.trials
    pa, pt = list(ak.pos_accepted), list(ak.pos_trials)
    ak.observe(r, 4, 2)
    assert (s.accepted, s.trials) == (0.8 * acc + 1, 0.8 * tri + 1)
    d = 0.995
    assert ak.pos_trials[:4] == [d * pt[0] + 1, d * pt[1] + 1, d * pt[2] + 1, pt[3]]
    assert ak.pos_accepted[:4] == [d * pa[0] + 1, d * pa[1] + 1, d * pa[2], pa[3]]


def test_a_drafter_whose_deep_drafts_fail_keeps_k_low():
    """Drafts are not i.i.d.: the default model's MTP head is accepted at 0.61 at position 1 but 0.40
    (given the first) at position 2. With its profile learned, a request at a_1 = 0.6 drafts 1, where
    the i.i.d. rule would draft 2."""
    assert best_k(0.6, 3, cost=0.25) == 2
    assert best_k(0.6, 3, cost=0.25, depth=[1.0, 0.4 / 0.61, 0.31 / 0.61]) == 1
    assert expected_tokens(0.5, 2, [1.0, 0.5]) == 1 + 0.5 + 0.5 * 0.25
    ak = AdaptiveK(k_max=3)
    ak.set_cost(0.25)
    for i in range(300):  # position 1 accepted 3 times in 5, position 2 (given 1) 2 times in 5
        req = Request(f"r{i}", [1], None)
        n = 0 if i % 5 < 2 else (2 if i % 5 == 4 else 1)
        ak.observe(req, 2, n)
    assert abs(ak.depth()[1] - (1 / 3) / 0.6) < 0.05
    req = Request("x", [1], None)
    for _ in range(10):  # this request's own first drafts: accepted 60% of the time
        ak.observe(req, ak.k_for(req), 1)
        ak.observe(req, ak.k_for(req), 1)
        ak.observe(req, ak.k_for(req), 0)
    assert ak.k_for(req) == 1


def test_measured_verify_costs_price_each_draft_length():
    """A verify of 3 rows that costs far more than twice a 2-row verify (measured at warmup) keeps k at 1."""
    ak = AdaptiveK(k_max=2)
    ak.set_cost(0.1, verify_costs={1: 0.1, 2: 0.2}, draft_cost=0.05)
    assert abs(ak.step_cost(1) - 0.15) < 1e-9 and abs(ak.step_cost(2) - 0.3) < 1e-9 and ak.k0 == 2
    ak.set_cost(0.1, verify_costs={1: 0.1, 2: 0.9}, draft_cost=0.05)
    assert ak.k0 == 1
    assert AdaptiveK(k_max=3).step_cost(3) == 3 * 0.25  # nothing measured: TOKEN_COST per draft


def test_pinned_k_never_moves():
    ak = AdaptiveK(k_max=4, enabled=False)
    req = Request("r", [1], None)
    for _ in range(5):
        ak.observe(req, 4, 0)
    assert ak.k_for(req) == 4


def test_drafting_stops_when_it_does_not_pay_and_probes_its_way_back():
    from ember.spec.adaptive import PROBE_EVERY

    assert best_k(0.1, 4, cost=0.25, allow_off=True) == 0 and best_k(0.1, 4, cost=0.25) == 1
    assert best_k(0.4, 4, cost=0.25, allow_off=True) == 1
    ak = AdaptiveK(k_max=4)
    req = Request("r", [1], None)
    for _ in range(6):
        ak.observe(req, 1, 0)
        if ak.state(req).k == 0:  # off: a further rejection would be a rejected probe, which backs off
            break
    assert ak.state(req).k == 0
    ks = [ak.k_for(req) for _ in range(3 * PROBE_EVERY)]
    assert ks.count(1) == 3 and set(ks) == {0, 1}  # one probe every PROBE_EVERY steps
    for _ in range(6):  # the probes start getting accepted: drafting comes back
        ak.observe(req, 1, 1)
    assert ak.k_for(req) >= 1


def test_rejected_probes_back_off_to_the_slowest_probe_rate():
    """A drafter that is never right (a random MTP head): drafting goes off, each rejected probe doubles
    the wait for the next, so the drafted tokens fall to one per MAX_PROBE_EVERY steps; one accepted probe
    brings the first rate back."""
    from ember.spec.adaptive import MAX_PROBE_EVERY, PROBE_EVERY

    ak = AdaptiveK(k_max=3)
    req = Request("r", [1], None)
    drafted = []
    for _ in range(40 * MAX_PROBE_EVERY):
        k = ak.k_for(req)
        drafted.append(k)
        if k:
            ak.observe(req, k, 0)
    waits = [i for i, k in enumerate(drafted) if k]
    gaps = [b - a for a, b in zip(waits, waits[1:])]
    first_off = next(i for i, g in enumerate(gaps) if g > 1)
    assert gaps[first_off : first_off + 4] == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, 8 * PROBE_EVERY]
    assert set(gaps[-20:]) == {MAX_PROBE_EVERY}
    tail = drafted[-20 * MAX_PROBE_EVERY :]
    assert sum(tail) == 20  # one one-token probe per MAX_PROBE_EVERY steps
    assert sum(drafted) < first_off * 3 + 4 + len(drafted) / MAX_PROBE_EVERY
    ak.observe(req, 1, 1)  # a probe accepted (the text turned predictable): back to probing often
    assert ak.state(req).probe_every == PROBE_EVERY


def test_a_new_request_starts_from_the_drafters_record():
    """Before any verify a request starts hopeful (k0); once the drafter is never right (a random MTP head),
    a new request starts off and waits the drafter's probe interval before its first probe, so short requests
    do not each pay a hopeful start and probes at 8, 24, 56 steps; a drafter that is right keeps them on."""
    from ember.spec.adaptive import MAX_PROBE_EVERY, PRIOR_TRIALS

    ak = AdaptiveK(k_max=2)
    assert ak.k_for(Request("first", [1], None)) == ak.k0 >= 1
    for i in range(6):  # short requests, every draft rejected
        req = Request(f"r{i}", [1], None)
        for _ in range(4 * MAX_PROBE_EVERY):
            k = ak.k_for(req)
            if k:
                ak.observe(req, k, 0)
    assert ak.drafter_alpha() < 0.2 and ak.probe_every == MAX_PROBE_EVERY
    new = Request("new", [1], None)
    ks = [ak.k_for(new) for _ in range(MAX_PROBE_EVERY)]
    assert ks == [0] * (MAX_PROBE_EVERY - 1) + [1]  # off from its first step: one probe after the drafter's wait
    s = ak.state(new)
    assert abs(s.accepted / s.trials - ak.drafter_alpha()) < 1e-9 and s.trials == PRIOR_TRIALS
    seeded = Request("seeded", [1], SamplingParams(temperature=0.8, seed=7))
    assert ak.k_for(seeded) == ak.k0  # its tokens may not depend on the requests before it: the hopeful start
    good = AdaptiveK(k_max=2)
    for i in range(6):
        req = Request(f"g{i}", [1], None)
        for _ in range(5):
            good.observe(req, good.k_for(req), good.k_for(req))
    assert good.k_for(Request("next", [1], None)) == 2
