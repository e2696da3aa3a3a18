"""The engine's side of speculation: whom to draft for and how many, what was accepted, stats.

After each step the engine hands over what the runner kept of it (after_step) and asks for drafts
for every running request that will decode next (its last sampled token is its only uncomputed
one) and has none pending. Each gets at most min(adaptive k, tokens it may still emit - 1, room
before max_model_len - 1): a draft that cannot be emitted is pure waste. With
disable_by_batch_size, a step with that many running requests drafts for none of them (the
proposer's after_step still runs: its cache is filled, at once or, for MTP, later in one batch). After a verify step, `verified` counts
what the rejection sampler accepted (the scheduler un-computes the rest) and feeds adaptive k.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Iterable

from ember.config.speculative import SpeculativeConfig
from ember.spec.adaptive import TOKEN_COST, AdaptiveK
from ember.spec.metrics import SpecStats
from ember.spec.proposer import ExecutorFactory, KVSlots, ProposerContext, StepRows, build_proposer

if TYPE_CHECKING:
    from ember.engine.executor.base import StepExecutor
    from ember.engine.scheduler import SchedulerOutput
    from ember.request import Request

logger = logging.getLogger("ember")


class Speculator:
    def __init__(self, spec: SpeculativeConfig, ctx: ProposerContext):
        self.config = spec
        self.proposer = build_proposer(spec, ctx)
        # A proposer may fix k itself when the config leaves it open (MTP: its number of layers).
        self.k_max = spec.num_speculative_tokens or self.proposer.num_speculative_tokens
        # A drafter that runs a forward per draft token (MTP, a draft model) makes each one dearer.
        self.draft_token_cost = self.proposer.draft_token_cost
        self.adaptive = AdaptiveK(self.k_max, enabled=spec.adaptive, cost=TOKEN_COST + self.draft_token_cost)
        self.stats = SpecStats(self.k_max)
        self.max_model_len = ctx.max_model_len
        self._unpriced = None  # a compiled executor whose graph timings are not read yet
        logger.info(
            "speculative decoding: %s, k = %d%s",
            spec.method,
            self.k_max,
            " (adaptive per request)" if spec.adaptive else " (fixed)",
        )

    @property
    def reads_step(self) -> str | None:
        return self.proposer.reads_step

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        """The proposer's own KV bytes per token (its layers in the runner's pool); 0 for none."""
        return self.proposer.kv_bytes_per_token(elem_bytes)

    def attach(self, slots: KVSlots) -> None:
        self.proposer.attach(slots)

    def prepare(self, executor: StepExecutor, make_executor: ExecutorFactory) -> None:
        """Once the engine's executor exists: the proposer may compile its own steps alike, and a
        verified token is priced from the executor's own timings when it has them (the compiled CPU
        executor times its graphs at warmup: there a verify row costs a few percent of a step, not
        TOKEN_COST's 25% measured eagerly), so adaptive k does not stop drafting on text that pays."""
        self.proposer.prepare(make_executor)
        self._unpriced = executor if executor.name == "compiled" else None
        self._price_verifies()

    def _price_verifies(self) -> None:
        """Once the compiled executor has timed its graphs (at start, or when a background compile
        finishes: checked before each proposal until then), price a verified token from them."""
        executor = self._unpriced
        if executor is None or not executor.timed:
            return
        self._unpriced = None
        verify = executor.extra_query_cost()
        if verify is None:
            return
        costs = executor.verify_costs()
        self.adaptive.set_cost(verify + self.draft_token_cost, costs, self.draft_token_cost)
        logger.info(
            "speculative decoding: verifying k drafts costs %s of a decode step (measured at warmup), "
            "plus %.3f a draft",
            ", ".join(f"k={k}: {c:.3f}" for k, c in sorted(costs.items())),
            self.draft_token_cost,
        )

    def verified(self, out: SchedulerOutput, sampled: dict, seconds: float) -> dict[str, int]:
        """After a step with drafts (out: its SchedulerOutput, sampled: what each request emitted):
        record what was accepted; returns the rejected draft count per request."""
        self.stats.verify_seconds += seconds
        rejected = {}
        for req, _ in out.scheduled:
            draft = out.drafts.get(req.request_id)
            if draft is not None:
                accepted = len(sampled[req.request_id]) - 1
                rejected[req.request_id] = len(draft) - accepted
                self.observe(req, len(draft), accepted)
        return rejected

    def propose(self, requests: Iterable[Any], step: StepRows | None = None) -> None:
        """step: what the runner kept of the step just run, for the proposer's after_step."""
        if self._unpriced is not None:
            self._price_verifies()
        requests = list(requests)
        off_at = self.config.disable_by_batch_size
        batch_off = off_at is not None and len(requests) >= off_at
        todo, ks = ([], []) if batch_off else self._who_drafts(requests)
        t0 = time.perf_counter()
        # who drafts is known first: the proposer may put off its work for the others (MTP: their fill)
        self.proposer.after_step(step, {req.request_id for req in todo})
        self.stats.draft_seconds += time.perf_counter() - t0
        if batch_off:
            self.stats.batch_disabled_steps += 1
            return
        if not todo:
            return
        t0 = time.perf_counter()
        drafts = self.proposer.propose(todo, ks)
        self.stats.draft_seconds += time.perf_counter() - t0
        for req, draft, k in zip(todo, drafts, ks):
            if draft is not None and len(draft):
                req.draft = draft.truncated(k)

    def _who_drafts(self, requests: list) -> tuple[list, list[int]]:
        """The requests that draft next and how many tokens each: adaptive k (0: none), capped by what
        the request may still emit."""
        todo, ks = [], []
        for req in requests:
            if req.draft is not None or req.num_computed_tokens != req.num_tokens - 1:
                continue
            p = req.sampling_params
            max_tokens = p.max_tokens if p.max_tokens is not None else self.max_model_len
            k = min(
                self.adaptive.k_for(req),
                max_tokens - req.num_output_tokens - 1,
                self.max_model_len - req.num_tokens - 1,
            )
            if k >= 1:
                todo.append(req)
                ks.append(k)
        return todo, ks

    def observe(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        self.stats.record(num_drafts, num_accepted)
        self.adaptive.observe(req, num_drafts, num_accepted)
