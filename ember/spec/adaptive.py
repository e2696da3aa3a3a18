"""Adaptive k: each request drafts as many tokens as its recent acceptance pays for.

The rule. A request keeps a decayed count of draft positions tested (trials) and accepted;
alpha = accepted / trials estimates its per-token acceptance (a rejection ends a step's
trials, so positions after it are not counted as failures: the geometric MLE). With i.i.d.
acceptance alpha, k drafts yield E[N] = (1 - alpha^(k+1)) / (1 - alpha) tokens for a step
costing 1 + k * c, where c is the cost of one more verified (and drafted) token relative to
a plain decode step. k is the argmax of E[N] / (1 + k c) over 1..k_max: e.g. with c = 0.25,
alpha 0.9 -> 6, 0.8 -> 3, 0.6 -> 2, 0.3..0.5 -> 1. c is TOKEN_COST (eager) or what the compiled
executor measured at warmup (Speculator.prepare: ~0.1 at batch 1 on the default model), plus the
drafter's own share. High temperature and prose lower it; code
and repetition raise it. When no k >= 1 beats a plain decode step (E[N] / (1 + k c) < 1, i.e.
alpha < c), the request stops drafting (k = 0) and probes with one draft every PROBE_EVERY
steps, so it comes back when its text turns predictable again. `--no-adaptive-spec` pins
k = k_max.
"""
from __future__ import annotations

from dataclasses import dataclass

# One extra verify row on CPU, relative to a 1-token step, eager (the compiled executor times its own
# graphs at warmup, Speculator.prepare): DESIGN.md measures a 4-token verify
# at 1.6-1.9x a decode, i.e. ~0.25 per extra token. A drafter with a forward adds its own share.
TOKEN_COST = 0.25
DECAY = 0.8  # weight of the past per observed step: ~5 steps of memory
PRIOR_ALPHA, PRIOR_TRIALS = 0.8, 2.0  # a new request starts hopeful, and one step cannot floor it
PROBE_EVERY = 8  # steps without drafts between two one-draft probes of a request that stopped drafting


def best_k(alpha: float, k_max: int, cost: float = TOKEN_COST, allow_off: bool = False) -> int:
    """argmax over k in 1..k_max of expected tokens per unit of step cost; with allow_off, 0 when
    none of them beats a plain decode step (1 token per unit)."""
    best, best_rate = 1, -1.0
    for k in range(1, k_max + 1):
        tokens = k + 1 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        rate = tokens / (1.0 + k * cost)
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return 0 if allow_off and best_rate < 1.0 else best


@dataclass
class SpecState:
    """One request's acceptance history and current k (lives on Request.spec_state)."""

    k: int  # 0: drafting is off for now (probes with 1 every PROBE_EVERY steps)
    accepted: float = PRIOR_ALPHA * PRIOR_TRIALS
    trials: float = PRIOR_TRIALS
    idle: int = 0  # steps since drafting went off or the last probe

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool = True, cost: float = TOKEN_COST, decay: float = DECAY):
        self.k_max, self.enabled, self.cost, self.decay = k_max, enabled, cost, decay
        self.k0 = best_k(PRIOR_ALPHA, k_max, cost) if enabled else k_max

    def set_cost(self, cost: float) -> None:
        self.cost = cost
        if self.enabled:
            self.k0 = best_k(PRIOR_ALPHA, self.k_max, cost)

    def state(self, req) -> SpecState:
        if req.spec_state is None:
            req.spec_state = SpecState(self.k0)
        return req.spec_state

    def k_for(self, req) -> int:
        """Drafts for this request's next step (0 = none); called once per step it decodes in."""
        s = self.state(req)
        if s.k > 0:
            return s.k
        s.idle += 1
        if s.idle >= PROBE_EVERY:
            s.idle = 0
            return 1
        return 0

    def observe(self, req, num_drafts: int, num_accepted: int) -> None:
        """A verify of num_drafts drafts accepted the first num_accepted of them."""
        if num_drafts <= 0 or not self.enabled:
            return
        s = self.state(req)
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        s.accepted = self.decay * s.accepted + num_accepted
        s.trials = self.decay * s.trials + trials
        s.k = best_k(s.alpha, self.k_max, self.cost, allow_off=True)
