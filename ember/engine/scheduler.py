"""One-budget scheduler, vLLM-v1 style (plain Python, no torch).

There is no prefill phase and no decode phase: each request has num_computed_tokens and
num_tokens, and a step hands out up to max_num_batched_tokens tokens so the first catches
up with the second. Running requests go first (a decode asks for 1 token, an unfinished
prefill for the rest of its prompt), then waiting ones in arrival order; whatever does not
fit the remaining budget becomes a chunk, finished in later steps. When the block pool runs
dry, the newest running request is preempted: its blocks are freed and it is recomputed
later (the prefix cache usually gives most of them back).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class SchedulerOutput:
    # (request, number of its tokens to run this step), in batch order.
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, enable_chunked_prefill: bool = True):
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
            if not self._allocate_or_preempt(req, n, out):
                break  # req itself was preempted; everything after it already was
            out.scheduled.append((req, n))
            budget -= n
            i += 1

        # Admit waiting requests only when nothing had to be preempted this step.
        while self.waiting and budget > 0 and not out.preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req) if req.num_computed_tokens == 0 else []
            num_cached = len(cached) * self.kv.block_size
            n = req.num_tokens - req.num_computed_tokens - num_cached
            if n > budget and not self.enable_chunked_prefill:
                break  # waits for a step with the whole budget free
            n = min(n, budget)
            if not self.kv.allocate_slots(req, n, cached):
                break
            self.waiting.popleft()
            req.num_computed_tokens += num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n

        self.step_count += 1
        if logger.isEnabledFor(logging.DEBUG) and out.scheduled:
            chunks = [n for r, n in out.scheduled if r.num_computed_tokens + n < r.num_tokens or n > 1]
            decodes = sum(1 for _, n in out.scheduled if n == 1)
            logger.debug("step %d: %d tokens scheduled, prefill chunks %s, %d decodes, %d waiting, KV %.1f%% used (%d/%d blocks free)%s",
                         self.step_count, out.num_tokens, chunks, decodes, len(self.waiting), 100 * self.kv.usage,
                         self.kv.num_free_blocks, self.kv.num_blocks,
                         f", preempted {[r.request_id for r in out.preempted]}" if out.preempted else "")
        return out

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
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (recompute %d tokens later)", req.request_id, req.num_tokens)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """Advance computed counts and name newly full blocks for the prefix cache."""
        for req, n in out.scheduled:
            req.num_computed_tokens += n
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
        self.kv.free(req)
        self.requests.pop(req.request_id, None)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        self.finish_request(req, RequestStatus.FINISHED_ABORTED)
        return True
