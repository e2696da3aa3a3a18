"""The Proposer seam: after a step, propose up to k draft tokens per decoding request.

The scheduler only sees "request r has d pending draft tokens" (it schedules 1 + d); the runner
puts them into the step and the rejection sampler verifies them. A proposer never touches
the KV pool of the target or the scheduler: a new drafter is one class registered below.

A proposer is built once per engine as cls(spec_config, engine) (it may read engine.runner,
engine.model_config, ... at build time: an MTP or draft-model proposer loads its weights
there) and called once per step with the requests that will decode next.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    from ember.engine.request import Request
    from ember.spec.config import SpeculativeConfig


@dataclass
class Draft:
    """A request's pending draft tokens: positions num_tokens, num_tokens + 1, ..."""

    token_ids: list[int]
    # [len(token_ids), V] draft distributions q (torch), or None for deterministic drafts
    # (n-gram, argmax MTP): q is then one-hot and the rejection sampler accepts with p(x).
    probs: Any = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, d: int) -> Draft:
        if d >= len(self.token_ids):
            return self
        return Draft(self.token_ids[:d], None if self.probs is None else self.probs[:d])


class Proposer(Protocol):
    # Only read when the config leaves num_speculative_tokens open (MTP: its number of layers).
    num_speculative_tokens: int
    # Optional: the cost of drafting one token relative to a plain decode step (adaptive k
    # weighs it with the verify cost); absent = free, as for n-gram.
    draft_token_cost: float

    def propose(self, requests: Sequence[Request], max_tokens: Sequence[int]) -> list[Draft | None]:
        """Per request, at most max_tokens[i] (>= 1) draft tokens following its token_ids
        (prompt + output), or None when it has no guess."""
        ...


# method -> "module:Class"; imported on first use so the config check stays light.
PROPOSERS: dict[str, str] = {
    "ngram": "ember.spec.ngram:NgramProposer",
    "mtp": "ember.spec.mtp_proposer:MTPProposer",
    "draft": "ember.spec.draft:DraftModelProposer",
}


def available_methods() -> tuple[str, ...]:
    return tuple(PROPOSERS)


def build_proposer(spec: SpeculativeConfig, engine: Any) -> Proposer:
    module, _, cls = PROPOSERS[spec.method].partition(":")
    return getattr(importlib.import_module(module), cls)(spec, engine)
