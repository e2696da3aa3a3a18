"""Speculative decoding counters: acceptance per draft position, mean accepted length, draft vs verify time.

Named as vLLM's spec-decode metrics (num_drafts, num_draft_tokens, num_accepted_tokens,
num_accepted_tokens_per_pos) so the same dashboards read them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    k_max: int
    num_drafts: int = 0  # verify steps of one request that carried >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [k_max]: drafts accepted at position i
    drafted_per_pos: list[int] = field(default_factory=list)  # [k_max]: drafts verified at position i
    draft_seconds: float = 0.0  # proposer time
    verify_seconds: float = 0.0  # steps that verified drafts (forward + sampling)
    batch_disabled_steps: int = 0  # steps that drafted nothing: disable_by_batch_size running requests or more

    def __post_init__(self) -> None:
        self.accepted_per_pos = self.accepted_per_pos or [0] * self.k_max
        self.drafted_per_pos = self.drafted_per_pos or [0] * self.k_max

    def record(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_drafts):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (1 + accepted drafts); 0 before the first one."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def acceptance_per_pos(self) -> list[float]:
        """P(draft i accepted | draft i proposed), per position."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def as_dict(self) -> dict:
        return {
            "spec_num_drafts": self.num_drafts,
            "spec_num_draft_tokens": self.num_draft_tokens,
            "spec_num_accepted_tokens": self.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_num_draft_tokens_per_pos": list(self.drafted_per_pos),
            "spec_acceptance_per_pos": self.acceptance_per_pos(),
            "spec_mean_accepted_length": self.mean_accepted_length,
            "spec_draft_seconds": self.draft_seconds,
            "spec_verify_seconds": self.verify_seconds,
        }
