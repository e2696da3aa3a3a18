"""One-budget scheduler, vLLM-v1 style (plain Python, no torch).

There is no prefill phase and no decode phase: each request has num_computed_tokens and
num_tokens, and a step hands out up to max_num_batched_tokens tokens so the first catches
up with the second. Running requests go first (a decode asks for 1 token, an unfinished
prefill for the rest of its prompt), then waiting ones in arrival order; whatever does not
fit the remaining budget becomes a chunk, finished in later steps. When the block pool runs
dry, the newest running request is preempted: its blocks are freed and it is recomputed
later (the prefix cache usually gives most of them back).

Speculative decoding: a decoding request with d pending draft tokens (req.draft) asks for
1 + d tokens (its last sampled token and the drafts) and 1 + d KV slots. Drafts are the
first thing to give: they only get budget left after one token for every running request
behind them, and a request whose lookahead slots do not fit drops its drafts before anyone
is preempted. After the step the runner reports how many drafts were rejected; their
tokens are not counted as computed (their K/V is overwritten later).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from ember.engine.kv_cache import KVCacheManager
from ember.request import Draft, Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    # (request, number of its tokens to run this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # request id -> the draft tokens it verifies this step (the last d of its n scheduled tokens).
    drafts: dict[str, Draft] = field(default_factory=dict)
    # Hybrid models: recurrent-state copies (src slot, dst slot) to make before the forward, in order
    # (prefix-cache restores; ember.engine.state_slots).
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts.values())

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
    ):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.step_count = 0

    def add_request(self, request: Request) -> None:
        self.waiting.append(request)
        self.requests[request.request_id] = request

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            d = self._num_drafts(req, n, budget, behind=len(self.running) - i - 1)
            if d and not self.kv.allocate_slots(req, n + d):
                d = 0  # no room for the lookahead slots: drop the drafts, preempt nobody for them
            if not d and not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted; everything after it already was
            if d:
                out.drafts[req.request_id] = req.draft.truncated(d)
            req.draft = None  # consumed (or dropped): the next step proposes afresh
            out.scheduled.append((req, n + d))
            budget -= n + d
            i += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # prompt logprobs come from the prompt's own positions: a request that asks for them computes all
            hit = (
                self.kv.find_cached_prefix(req)
                if req.num_computed_tokens == 0 and req.prompt_logprobs is None
                else None
            )
            num_cached = hit.num_tokens if hit is not None else 0
            n = req.num_tokens - req.num_computed_tokens - num_cached
            if n > budget and not self.enable_chunked_prefill:
                break  # waits for a step with the whole budget free
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, hit):
                break
            self.waiting.popleft()
            req.num_computed_tokens += num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.first_scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n

        if self.kv.states is not None:
            out.state_copies = self.kv.states.take_copies()
        self.step_count += 1
        if logger.isEnabledFor(logging.DEBUG) and out.scheduled:
            chunks = [
                n
                for r, n in out.scheduled
                if r.request_id not in out.drafts and (r.num_computed_tokens + n < r.num_tokens or n > 1)
            ]
            decodes = sum(1 for r, n in out.scheduled if n == 1 or r.request_id in out.drafts)
            logger.debug(
                "step %d: %d tokens scheduled, prefill chunks %s, %d decodes (+%d draft tokens), %d waiting, "
                "KV %.1f%% used (%d/%d blocks free)%s",
                self.step_count,
                out.num_tokens,
                chunks,
                decodes,
                out.num_draft_tokens,
                len(self.waiting),
                100 * self.kv.usage,
                self.kv.num_free_blocks,
                self.kv.num_blocks,
                f", preempted {[r.request_id for r in out.preempted]}" if out.preempted else "",
            )
        return out

    @staticmethod
    def _num_drafts(req: Request, n: int, budget: int, behind: int) -> int:
        """How many of req's drafts ride on its decode: what the budget leaves after this
        token and one for each of the `behind` running requests after it."""
        if req.draft is None or n != 1:  # drafts follow a decode only (n == 1: the last sampled token)
            return 0
        return max(0, min(len(req.draft), budget - 1 - behind))

    def _allocate_or_preempt(self, req: Request, n: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, n):
            victim = self.running.pop()  # newest running request has the lowest priority
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.draft = None
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (recompute %d tokens later)", req.request_id, req.num_tokens)

    def update_after_step(self, out: SchedulerOutput, num_rejected: dict[str, int] | None = None) -> None:
        """Advance computed counts (less each request's rejected drafts) and name newly full
        blocks for the prefix cache."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n - (num_rejected.get(req.request_id, 0) if num_rejected else 0)
            self.kv.cache_full_blocks(req)

    def finish_request(self, req: Request, status: RequestStatus) -> None:
        """Finish (or abort) a request wherever it is and free its blocks."""
        if req.is_finished:
            return
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        req.draft = None
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True
