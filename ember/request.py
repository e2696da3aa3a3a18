"""Request: one sequence's state as the scheduler, the runner and a proposer see it (plain Python,
no torch), and Draft: the tokens a proposer guessed for it.

A leaf module: the engine schedules Requests, speculation reads them, neither imports the other
for it.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from ember.engine.detokenizer import IncrementalDetokenizer
    from ember.sampling import SamplingParams
    from ember.spec.adaptive import SpecState
    from ember.structured.manager import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass
class Draft:
    """A request's pending draft tokens: positions num_tokens, num_tokens + 1, ..."""

    token_ids: list[int]
    # [len(token_ids), V] draft distributions q (torch), or None for deterministic drafts
    # (n-gram, argmax MTP): q is then one-hot and the rejection sampler accepts with p(x).
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def truncated(self, d: int) -> "Draft":
        if d >= len(self.token_ids):
            return self
        return Draft(self.token_ids[:d], None if self.probs is None else self.probs[:d])


class Request:
    """token_ids = prompt + output. num_computed_tokens of them have K/V in the cache.

    A step schedules n = num_tokens - num_computed_tokens tokens (fewer when the budget is
    short: a prefill chunk); only a step that reaches num_tokens produces a new token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams | None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 = not scheduled yet
        self.first_scheduled_time: float | None = None  # monotonic; the end of its queue time (metrics)
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of this request's full blocks
        self.num_preemptions = 0
        # Hybrid models (ember.engine.state_slots): the live recurrent-state slot; this step's planned
        # snapshots and computed-but-unnamed ones, as (position, snapshot slot); the name of the deepest
        # snapshot it named or restored (the one its next snapshot supersedes).
        self.state_slot: int | None = None
        self.state_plan: list[tuple[int, int]] = []
        self.unnamed_snapshots: list[tuple[int, int]] = []
        self.snapshot_head: int | None = None
        self.stop_reason: int | str | None = None
        # Speculative decoding: draft tokens proposed for the next step (a Draft,
        # consumed when scheduled) and the adaptive-k state (ember.spec.adaptive.SpecState).
        self.draft: Draft | None = None
        self.spec_state: SpecState | None = None
        # Structured outputs: the request's grammar and matcher (ember.structured.manager.GrammarState).
        self.grammar: GrammarState | None = None
        # Filled by the engine: detokenizer, logprobs, parent for n > 1.
        self.logprobs: list | None = None
        # SamplingParams.prompt_logprobs: one PositionLogprobs per prompt token (None for the first),
        # filled chunk by chunk during prefill.
        self.prompt_logprobs: list | None = None
        self.detokenizer: IncrementalDetokenizer | None = None
        self.parent_id: str | None = None
        self.index = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.is_finished else None

    def decoded_prompt_logprobs(self) -> list | None:
        """The prompt logprobs so far, each entry's decoded_token filled in (by the detokenizer)."""
        lps = self.prompt_logprobs
        if lps is None:
            return None
        for pos in lps[1:]:
            for tid, lp in pos.items():
                if lp.decoded_token is None:
                    lp.decoded_token = self.detokenizer.decoded_token(tid)
        return lps

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"blocks={len(self.block_ids)}, {self.status.value})"
        )
