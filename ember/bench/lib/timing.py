"""Timing ember through its own step loop (add_request / step, the path the server's streaming takes, so a
time to first token includes scheduling and sampling) and through LLM.generate for a batch.

Decode is reported two ways from the same per-token timestamps (first token excluded, so prefill is
not in it):
- mean: (N - 1) / (last token time - first token time);
- steady: 1 / median gap between consecutive tokens. A burst of someone else's work on the
  shared machine stretches a few gaps; the median ignores them, the mean does not. On a quiet
  machine the two agree.
"""

from __future__ import annotations

import statistics
import time

from ember.sampling import SamplingParams

DECODE_PROMPT_LEN = 32  # "a short prompt": decode speed should not depend on a long context


def token_times(engine, request_id: str, prompt: list[int], params: SamplingParams, fresh: bool = True) -> list[float]:
    """Drive one request to the end through engine.step(); the perf_counter time each of its tokens
    arrived (a step that brings several, a speculative verify, stamps them all with its time).
    fresh: the prompt must not hit the prefix cache (a time to first token would say nothing)."""
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                now = time.perf_counter()
                assert not (fresh and out.num_cached_tokens), (
                    "the prefix cache served a benchmark prompt; prompts must be fresh"
                )
                times += [now] * (len(out.outputs[0].token_ids) - len(times))
    return times


def _run_one(engine, request_id: str, prompt: list[int], max_tokens: int, fresh: bool = True) -> list[float]:
    """One greedy request of exactly max_tokens tokens (EOS ignored): its token arrival times."""
    times = token_times(
        engine, request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), fresh
    )
    assert len(times) == max_tokens, f"ember produced {len(times)} tokens, wanted {max_tokens}"
    return times


def ember_decode(engine, request_id: str, prompt: list[int], n: int) -> list[float]:
    # Decode rates start at the first token, so a cached prefix (a chat template's system prompt) changes nothing.
    return _run_one(engine, request_id, prompt, n, fresh=False)


def ember_ttft(engine, request_id: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    times = _run_one(engine, request_id, prompt, 1)
    return times[0] - t0


def decode_rates(times: list[float]) -> tuple[float, float]:
    """(mean tok/s, steady tok/s) over tokens 2..N; see the module docstring.

    A step that brings m tokens at once (speculative decoding) gives each of them 1/m of its gap."""
    gaps: list[float] = []
    i = 1
    while i < len(times):
        m = 1
        while i + m < len(times) and times[i + m] == times[i]:
            m += 1
        gaps += [(times[i] - times[i - 1]) / m] * m
        i += m
    return len(gaps) / (times[-1] - times[0]), 1.0 / statistics.median(gaps)


def ember_batch(llm, prompts: list[list[int]], output_len: int | list[int]) -> tuple[float, int]:
    """One LLM.generate over all prompts, output_len tokens each (a list: one length per prompt), EOS
    ignored; returns (seconds, generated tokens)."""
    if isinstance(output_len, list):
        want = sum(output_len)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_len]
    else:
        want = output_len * len(prompts)
        params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert not any(o.num_cached_tokens for o in outs), (
        "the prefix cache served a benchmark prompt; prompts must be fresh"
    )
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == want, f"ember generated {generated} tokens, wanted {want}"
    return seconds, generated
