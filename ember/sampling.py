"""SamplingParams: how one request picks its tokens and when it stops.

Names and defaults follow vLLM's SamplingParams so a vLLM user's request works unchanged.
Every field is checked once here, so the sampler and the engine can trust the values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ember.errors import InvalidRequestError
from ember.structured_params import StructuredOutputsParams

# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf/nan.
GREEDY_EPS = 1e-5
# The most top-N logprobs a request may ask for by default (vLLM's --max-logprobs default).
MAX_LOGPROBS = 20


def _bad(name: str, value: object, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"SamplingParams.{name}={value!r} is invalid: {allowed}")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None  # normalised to list[str]
    stop_token_ids: list[int] | None = None  # normalised to list[int]
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-N; 0 = only the sampled token's logprob; -1 = all (capped by --max-logprobs)
    skip_special_tokens: bool = True
    # top-N logprobs of every prompt token after the first (vLLM's; -1 = the whole vocabulary). The prompt
    # is then computed in full: a prefix-cache hit would skip the positions these come from.
    prompt_logprobs: int | None = None
    # token id -> value added to its logit before sampling (OpenAI's logit_bias: -100 bans, +100 forces)
    logit_bias: dict[int, float] | None = None
    # The shape the answer must have (JSON schema, regex, choice, grammar); None = free text.
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalise()
        self._validate()

    # -- normalisation ---------------------------------------------------------------

    def _normalise(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:  # vLLM spells "off" as -1 too
            self.top_k = 0
        if _is_int(self.temperature):
            self.temperature = float(self.temperature)
        if isinstance(self.logit_bias, dict) and all(isinstance(k, str) for k in self.logit_bias):
            try:  # JSON object keys are strings
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise _bad("logit_bias", self.logit_bias, "token ids (integers) mapped to numbers") from None
        if self.logit_bias == {}:
            self.logit_bias = None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)

    # -- validation ------------------------------------------------------------------

    def _validate(self) -> None:
        self._check_int("n", self.n, lo=1, allowed="an integer >= 1")
        self._check_num("temperature", self.temperature, lo=0.0, allowed="a number >= 0 (0 = greedy)")
        if not (_is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise _bad("top_p", self.top_p, "a number in (0, 1] (1 = off)")
        self._check_int("top_k", self.top_k, lo=0, allowed="an integer >= 0 (0 or -1 = off)")
        if not (_is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise _bad("min_p", self.min_p, "a number in [0, 1] (0 = off)")
        if not (_is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise _bad("repetition_penalty", self.repetition_penalty, "a number > 0 (1 = off, > 1 discourages repeats)")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (_is_number(v) and -2.0 <= v <= 2.0):
                raise _bad(name, v, "a number in [-2, 2] (0 = off)")
        if self.seed is not None and not _is_int(self.seed):
            raise _bad("seed", self.seed, "an integer or None")
        if self.max_tokens is not None:
            self._check_int(
                "max_tokens", self.max_tokens, lo=1, allowed="an integer >= 1, or None for up to max_model_len"
            )
        self._check_int("min_tokens", self.min_tokens, lo=0, allowed="an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad(
                "min_tokens",
                self.min_tokens,
                f"must be <= max_tokens ({self.max_tokens}); lower min_tokens or raise max_tokens",
            )
        self._check_stop()
        if self.logit_bias is not None and not (
            isinstance(self.logit_bias, dict)
            and all(_is_int(k) and k >= 0 and _is_number(v) and -100 <= v <= 100 for k, v in self.logit_bias.items())
        ):
            raise _bad("logit_bias", self.logit_bias, "a map of token ids (>= 0) to numbers in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _bad(
                "structured_outputs",
                self.structured_outputs,
                "a StructuredOutputsParams, a dict of its fields, or None",
            )
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", self.stop_token_ids, "a list of non-negative token ids, or None")
        if self.logprobs is not None:
            self._check_int(
                "logprobs",
                self.logprobs,
                lo=-1,
                allowed="an integer >= -1 or None (0 = only the sampled token, -1 = the whole "
                f"vocabulary; the engine allows up to --max-logprobs, {MAX_LOGPROBS} by default)",
            )
        if self.prompt_logprobs is not None:
            self._check_int(
                "prompt_logprobs",
                self.prompt_logprobs,
                lo=-1,
                allowed="an integer >= -1 or None (0 = only the prompt token, -1 = the whole vocabulary)",
            )
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "true or false")

    def _check_stop(self) -> None:
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise _bad("stop", self.stop, "a string, a list of strings, or None")
        if any(s == "" for s in self.stop):
            raise _bad("stop", self.stop, "stop strings must be non-empty (an empty one matches everywhere)")

    @staticmethod
    def _check_int(name: str, v: object, lo: int, allowed: str, hi: int | None = None) -> None:
        if not _is_int(v) or v < lo or (hi is not None and v > hi):
            raise _bad(name, v, allowed)

    @staticmethod
    def _check_num(name: str, v: object, lo: float, allowed: str) -> None:
        if not _is_number(v) or v < lo:
            raise _bad(name, v, allowed)

    # -- derived views ---------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def max_stop_len(self) -> int:
        """Longest stop string, in characters (0 when there are none)."""
        return max((len(s) for s in self.stop), default=0)

    def replace(self, **changes) -> SamplingParams:
        """A validated copy with some fields changed (lists copied, never shared)."""
        kw = {
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            "logit_bias": dict(self.logit_bias) if self.logit_bias else None,
        }
        kw.update(changes)
        return dataclasses.replace(self, **kw)

    def clone(self) -> SamplingParams:
        return self.replace()
