"""Adaptive k: the k that maximises expected tokens per unit of step cost, from a decayed acceptance estimate."""
from ember.engine.request import Request
from ember.spec.adaptive import AdaptiveK, best_k


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
    assert ak.k_for(good) <= 2
    # A rejection ends a step's trials: 2 of 4 accepted is 2 successes in 3 trials, not 2 in 4.
    r = Request("r", [1], None)
    s = ak.state(r)
    acc, tri = s.accepted, s.trials
    ak.observe(r, 4, 2)
    assert (s.accepted, s.trials) == (0.8 * acc + 2, 0.8 * tri + 3)


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
    assert ak.state(req).k == 0
    ks = [ak.k_for(req) for _ in range(3 * PROBE_EVERY)]
    assert ks.count(1) == 3 and set(ks) == {0, 1}  # one probe every PROBE_EVERY steps
    for _ in range(6):  # the probes start getting accepted: drafting comes back
        ak.observe(req, 1, 1)
    assert ak.k_for(req) >= 1
