"""What a request must satisfy before the engine takes it: ids inside the vocabulary (prompt and
logit_bias), a prompt that fits max_model_len (and the step budget without chunked prefill), and
logprob counts within --max-logprobs (-1, the whole vocabulary, resolved here)."""
from __future__ import annotations

from ember.config import EngineConfig
from ember.errors import InvalidRequestError, PromptTooLongError
from ember.sampling import SamplingParams


def check_request(ids: list[int], params: SamplingParams, config: EngineConfig, vocab: int,
                  max_model_len: int) -> SamplingParams:
    """The params to run the request with (logprobs -1 resolved); raises what is wrong, saying what to change."""
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    bias = [t for t in (params.logit_bias or {}) if t >= vocab]
    if bias:
        raise InvalidRequestError(f"logit_bias token ids {bias[:5]} are outside the vocabulary [0, {vocab})")
    if len(ids) >= max_model_len:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens but max_model_len is {max_model_len} (prompt plus at least one "
            f"generated token must fit); shorten the prompt or raise --max-model-len")
    sched = config.scheduler_config
    if not sched.enable_chunked_prefill and len(ids) > sched.max_num_batched_tokens:
        raise PromptTooLongError(
            f"the prompt has {len(ids)} tokens, more than --max-num-batched-tokens {sched.max_num_batched_tokens}, "
            "and chunked prefill is off; enable chunked prefill or raise --max-num-batched-tokens")
    return _resolve_logprobs(params, vocab, config.max_logprobs)


def _resolve_logprobs(params: SamplingParams, vocab: int, cap: int) -> SamplingParams:
    changes = {}
    for name in ("logprobs", "prompt_logprobs"):
        n = getattr(params, name)
        if n is None:
            continue
        n = vocab if n == -1 else n
        if cap != -1 and n > cap:
            raise InvalidRequestError(f"{name}: {n} were asked for (-1 = the whole vocabulary of {vocab}), more "
                                      f"than --max-logprobs {cap}; ask for fewer or raise --max-logprobs")
        if n != getattr(params, name):
            changes[name] = n
    return params.replace(**changes) if changes else params
