"""Adaptive k: each request drafts as many tokens as its recent acceptance pays for.

The rule. A request keeps a decayed count of draft positions tested (trials) and accepted;
alpha = accepted / trials estimates its per-token acceptance (a rejection ends a step's
trials, so positions after it are not counted as failures: the geometric MLE). With i.i.d.
acceptance alpha, k drafts yield E[N] = (1 - alpha^(k+1)) / (1 - alpha) tokens for a step
costing 1 + k * c, where c is the cost of one more verified (and drafted) token relative to
a plain decode step. k is the argmax of E[N] / (1 + k c) over 1..k_max: e.g. with c = 0.25,
alpha 0.9 -> 6, 0.8 -> 3, 0.6 -> 2, <= 0.5 -> 1. High temperature and prose lower it; code
and repetition raise it. `--no-adaptive-spec` pins k = k_max.
"""
from __future__ import annotations

from dataclasses import dataclass

# One extra verify row on CPU, relative to a 1-token step: DESIGN.md measures a 4-token verify
# at 1.6-1.9x a decode, i.e. ~0.25 per extra token. A drafter with a forward adds its own share.
TOKEN_COST = 0.25
DECAY = 0.8  # weight of the past per observed step: ~5 steps of memory
PRIOR_ALPHA, PRIOR_TRIALS = 0.8, 2.0  # a new request starts hopeful, and one step cannot floor it


def best_k(alpha: float, k_max: int, cost: float = TOKEN_COST) -> int:
    """argmax over k in 1..k_max of expected tokens per unit of step cost."""
    best, best_rate = 1, -1.0
    for k in range(1, k_max + 1):
        tokens = k + 1 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        rate = tokens / (1.0 + k * cost)
        if rate > best_rate + 1e-12:
            best, best_rate = k, rate
    return best


@dataclass
class SpecState:
    """One request's acceptance history and current k (lives on Request.spec_state)."""

    k: int
    accepted: float = PRIOR_ALPHA * PRIOR_TRIALS
    trials: float = PRIOR_TRIALS

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials if self.trials > 0 else 0.0


class AdaptiveK:
    def __init__(self, k_max: int, enabled: bool = True, cost: float = TOKEN_COST, decay: float = DECAY):
        self.k_max, self.enabled, self.cost, self.decay = k_max, enabled, cost, decay
        self.k0 = best_k(PRIOR_ALPHA, k_max, cost) if enabled else k_max

    def state(self, req) -> SpecState:
        if req.spec_state is None:
            req.spec_state = SpecState(self.k0)
        return req.spec_state

    def k_for(self, req) -> int:
        return self.state(req).k

    def observe(self, req, num_drafts: int, num_accepted: int) -> None:
        """A verify of num_drafts drafts accepted the first num_accepted of them."""
        if num_drafts <= 0 or not self.enabled:
            return
        s = self.state(req)
        trials = num_accepted + (1 if num_accepted < num_drafts else 0)
        s.accepted = self.decay * s.accepted + num_accepted
        s.trials = self.decay * s.trials + trials
        s.k = best_k(s.alpha, self.k_max, self.cost)
