"""What a request must satisfy before the engine takes it: ids inside the vocabulary (prompt and
logit_bias), a prompt that fits max_model_len (and the step budget without chunked prefill), and
logprob counts within --max-logprobs (-1, the whole vocabulary, resolved here)."""

from __future__ import annotations

from ember.config import EngineConfig
from ember.errors import InvalidRequestError, PromptTooLongError
from ember.sampling import SamplingParams


def out_of_vocabulary(what: str, ids, vocab: int) -> str | None:
    """The error for ids outside [0, vocab), or None (vLLM's wording: clients match "out of vocabulary")."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if not bad:
        return None
    return f"{what} {bad[:5]} {'is' if len(bad) == 1 else 'are'} out of vocabulary: the vocabulary has {vocab} tokens (ids 0 to {vocab - 1})"


def check_request(
    ids: list[int], params: SamplingParams, config: EngineConfig, vocab: int, max_model_len: int, token_budget: int
) -> SamplingParams:
    """The params to run the request with (logprobs -1 resolved); raises what is wrong, saying what to change."""
    for what, given in (("prompt token id", ids), ("logit_bias token id", params.logit_bias or {})):
        if message := out_of_vocabulary(what, given, vocab):
            raise InvalidRequestError(message)
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_model_len} (prompt plus at least one "
            f"generated token must fit); shorten the prompt or raise --max-model-len"
        )
    sched = config.scheduler_config
    if not sched.enable_chunked_prefill and len(ids) > token_budget:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens, more than --max-num-batched-tokens {token_budget}, "
            "and chunked prefill is off; enable chunked prefill or raise --max-num-batched-tokens"
        )
    return _resolve_logprobs(params, vocab, config.max_logprobs)


def _resolve_logprobs(params: SamplingParams, vocab: int, cap: int) -> SamplingParams:
    changes = {}
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name)
        if n is None:
            continue
        n = vocab if n == -1 else n
        if cap != -1 and n > cap:
            raise InvalidRequestError(
                f"{name}: {n} were asked for (-1 = the whole vocabulary of {vocab}), more "
                f"than --max-logprobs {cap}; ask for fewer or raise --max-logprobs"
            )
        if n != getattr(params, name):
            changes[name] = n
    return params.replace(**changes) if changes else params
