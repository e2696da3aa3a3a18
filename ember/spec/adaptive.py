"""Adaptive k: each request drafts as many tokens as its recent acceptance pays for.

The rule. k drafts yield E[N] = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens, a_i being the
chance that draft i is accepted once drafts 1..i-1 were, for a step costing 1 + cost(k): the
verify's k extra rows plus k drafts, relative to a plain decode step. k is the argmax of
E[N] / (1 + cost(k)) over 1..k_max.

- a_1 is the request's own: a decayed count of its position-1 drafts accepted (DECAY: ~5 steps
  of memory). High temperature and prose lower it; code and repetition raise it.
- Deeper positions are a_i = a_1 * depth_i, where depth_i is the drafter's, learned over all
  requests: its conditional acceptance at position i over its acceptance at position 1. Drafts
  are not i.i.d.: the default model's MTP head, re-entered with its own output, is accepted at
  0.61 / 0.40 / 0.31 (conditional) at positions 1 / 2 / 3. Treating them as i.i.d. at a_1
  chose k = 2 where k = 1 was faster (docs/tuning.md, speculation).
- cost(k) = the verify's measured cost of 1 + k rows where the executor timed them at warmup
  (Speculator.prepare; the compiled CPU executor), else k * TOKEN_COST; plus k * the drafter's
  own cost per draft.

When no k >= 1 beats a plain decode step (E[N] / (1 + cost(k)) < 1), the request stops drafting
(k = 0) and probes with one draft after PROBE_EVERY steps, so it comes back when its text turns
predictable again. Each probe that is rejected doubles the wait before the next one, up to
MAX_PROBE_EVERY; an accepted one brings it back to PROBE_EVERY. A probe costs a verify row plus a draft
(with an MTP head, its LM head: a third of a small model's decode step), so a drafter that is never
right (a random MTP head) must cost next to nothing: one probe every 8 steps did not.

A new request starts from the drafter's own record, not from scratch: once the drafter has one, its
prior a_1 is the drafter's position-1 acceptance over all requests, so its first k is chosen as any later
one is and may be 0 (before any verify: k0, from PRIOR_ALPHA); one that starts off waits the drafter's
last probe interval before its first probe. With a random head, every short request started hopeful and
probed at 8, 24 and 56 steps: ~7% of decode speed on ember bench flash's model (64-token decodes). A
seeded request keeps the hopeful start: its tokens must not depend on the requests before it (how many
drafts a step verifies changes which draws its generator makes).
`--no-adaptive-spec` pins k = k_max.
"""

from __future__ import annotations

from dataclasses import dataclass

# One extra verify row on CPU, relative to a 1-token step, eager (the compiled executor times its own
# graphs at warmup, Speculator.prepare): DESIGN.md measures a 4-token verify
# at 1.6-1.9x a decode, i.e. ~0.25 per extra token. A drafter with a forward adds its own share.
TOKEN_COST = 0.25
DECAY = 0.8  # weight of a request's past per observed step: ~5 steps of memory
PRIOR_ALPHA, PRIOR_TRIALS = 0.8, 2.0  # a new request starts hopeful, and one step cannot floor it
# The drafter's depth profile: decayed per trial at a position (~200 trials of memory), starting from
# i.i.d. (depth 1) with the weight of PRIOR_DEPTH_TRIALS trials, so deep drafts get tried and learned.
DEPTH_DECAY, PRIOR_DEPTH_TRIALS = 0.995, 4.0
MAX_DEPTH_FACTOR = 1.5  # deeper drafts can be likelier than the first (a predictable stretch), within reason
PROBE_EVERY = 8  # steps without drafts before the first one-draft probe of a request that stopped drafting
MAX_PROBE_EVERY = 64  # rejected probes double the wait up to this: then a probe is ~1% of the steps


def expected_tokens(alpha: float, k: int, depth: list[float] | None = None) -> float:
    """1 + a_1 + a_1 a_2 + ... + a_1 ... a_k with a_1 = alpha, a_i = min(1, alpha * depth[i - 1])
    (depth[0] = 1; None: i.i.d., every a_i = alpha)."""
    total, p = 1.0, 1.0
    for i in range(k):
        p *= min(1.0, alpha * (depth[i] if depth is not None and i < len(depth) else 1.0))
        total += p
    return total


def best_k(alpha: float, k_max: int, cost=TOKEN_COST, allow_off: bool = False, depth: list[float] | None = None) -> int:
    """argmax over k in 1..k_max of expected tokens per unit of step cost; cost: per drafted token
    (a float) or cost(k) (a callable); with allow_off, 0 when none of them beats a plain decode
    step (1 token per unit)."""
    step_cost = cost if callable(cost) else (lambda k: k * cost)
    best, best_rate = 1, -1.0
    for k in range(1, k_max + 1):
        rate = expected_tokens(alpha, k, depth) / (1.0 + step_cost(k))
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return 0 if allow_off and best_rate < 1.0 else best


@dataclass
class SpecState:
    """One request's position-1 acceptance history and current k (lives on Request.spec_state)."""

    k: int  # 0: drafting is off for now (probes with 1 every PROBE_EVERY steps)
    accepted: float = PRIOR_ALPHA * PRIOR_TRIALS  # AdaptiveK.state: the drafter's acceptance as the prior
    trials: float = PRIOR_TRIALS
    idle: int = 0  # steps since drafting went off or the last probe
    probe_every: int = PROBE_EVERY  # steps without drafts before the next probe

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool = True, cost: float = TOKEN_COST, decay: float = DECAY):
        self.k_max, self.enabled, self.decay = k_max, enabled, decay
        self.cost = cost  # per drafted token, where no measured verify cost applies
        self.verify_costs: dict[int, float] = {}  # k -> measured cost of a verify of 1 + k rows
        self.draft_cost = 0.0  # the drafter's own cost per draft, on top of verify_costs
        # the drafter's conditional acceptance per position, over all requests: decayed counts
        self.pos_accepted = [PRIOR_ALPHA * PRIOR_DEPTH_TRIALS] * k_max
        self.pos_trials = [PRIOR_DEPTH_TRIALS] * k_max
        self.probe_every = PROBE_EVERY  # the last probe interval a request that stopped drafting reached
        self.observed = False  # whether any verify was seen: before, a request starts hopeful (k0)
        self.k0 = self._best(PRIOR_ALPHA) if enabled else k_max

    def set_cost(self, cost: float, verify_costs: dict[int, float] | None = None, draft_cost: float = 0.0) -> None:
        """cost: per drafted token (verify row + draft), for k without a measured verify;
        verify_costs: k -> measured cost of a verify of 1 + k rows, plus draft_cost per draft."""
        self.cost, self.verify_costs, self.draft_cost = cost, dict(verify_costs or {}), draft_cost
        if self.enabled:
            self.k0 = self._best(PRIOR_ALPHA)

    def step_cost(self, k: int) -> float:
        """What k drafts add to a decode step, as a share of it."""
        if k in self.verify_costs:
            return self.verify_costs[k] + k * self.draft_cost
        return k * self.cost

    def depth(self) -> list[float]:
        """The drafter's conditional acceptance at each position over its acceptance at position 1."""
        rates = [a / t for a, t in zip(self.pos_accepted, self.pos_trials)]
        first = max(rates[0], 1e-6)
        return [1.0] + [min(MAX_DEPTH_FACTOR, r / first) for r in rates[1:]]

    def _best(self, alpha: float, allow_off: bool = False) -> int:
        return best_k(alpha, self.k_max, self.step_cost, allow_off, self.depth())

    def drafter_alpha(self) -> float:
        """The drafter's position-1 acceptance over all requests (decayed; PRIOR_ALPHA before any)."""
        return self.pos_accepted[0] / self.pos_trials[0]

    def state(self, req) -> SpecState:
        """A request's state, made on first use from the drafter's record (the module docstring)."""
        if req.spec_state is None:
            params = getattr(req, "sampling_params", None)
            if not self.enabled or not self.observed or getattr(params, "seed", None) is not None:
                req.spec_state = SpecState(self.k0)
            else:
                alpha = self.drafter_alpha()
                k = self._best(alpha, allow_off=True)
                probe_every = PROBE_EVERY if k else self.probe_every
                req.spec_state = SpecState(k, alpha * PRIOR_TRIALS, PRIOR_TRIALS, probe_every=probe_every)
        return req.spec_state

    def k_for(self, req) -> int:
        """Drafts for this request's next step (0 = none); called once per step it decodes in."""
        s = self.state(req)
        if s.k > 0:
            return s.k
        s.idle += 1
        if s.idle >= s.probe_every:
            s.idle = 0
            return 1
        return 0

    def observe(self, req, num_drafts: int, num_accepted: int) -> None:
        """A verify of num_drafts drafts accepted the first num_accepted of them."""
        if num_drafts <= 0 or not self.enabled:
            return
        self.observed = True
        # position i was tried when drafts before it were accepted: 1 .. num_accepted + 1
        for i in range(min(num_drafts, num_accepted + 1, self.k_max)):
            self.pos_accepted[i] = DEPTH_DECAY * self.pos_accepted[i] + (1.0 if i < num_accepted else 0.0)
            self.pos_trials[i] = DEPTH_DECAY * self.pos_trials[i] + 1.0
        s = self.state(req)
        if s.k == 0:  # a probe: rejected, wait twice as long for the next; accepted, probe at the first rate again
            s.probe_every = PROBE_EVERY if num_accepted > 0 else min(MAX_PROBE_EVERY, 2 * s.probe_every)
            self.probe_every = s.probe_every  # where the next request that starts off begins
        s.accepted = self.decay * s.accepted + (1.0 if num_accepted > 0 else 0.0)
        s.trials = self.decay * s.trials + 1.0
        s.k = self._best(s.alpha, allow_off=True)
