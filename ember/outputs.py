"""What generate() returns, shaped like vLLM's RequestOutput so its users feel at home."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token at one position, from log_softmax of the raw step logits."""

    logprob: float
    rank: int  # 1 = the most likely token at this position
    decoded_token: str | None = None


# One dict per generated position: token id -> Logprob (the sampled token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per token
    prompt_logprobs: list[PositionLogprobs | None] | None = None
