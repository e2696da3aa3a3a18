"""Batch-1 latency: greedy decode speed after the first token, and time to first token (TTFT).

Both are taken through the engine's step loop (add_request / step), the same path the server's
streaming uses, so TTFT includes scheduling and sampling, not just the forward.

Decode is reported two ways from the same per-token timestamps (first token excluded, so
prefill is not in it):
- mean: (N - 1) / (last token time - first token time);
- steady: 1 / median gap between consecutive tokens. A burst of someone else's work on the
  shared machine stretches a few gaps; the median ignores them, the mean does not. On a quiet
  machine the two agree, so the bar is judged on the steady figure.
"""
from __future__ import annotations

import logging
import statistics
import time

from tqdm import tqdm

from ember.bench.report import Bar, Metric
from ember.bench.throughput import measure_pair, prompt_maker, prompt_seed
from ember.sampling import SamplingParams

logger = logging.getLogger("ember.bench")

DECODE_PROMPT_LEN = 32  # "a short prompt": decode speed should not depend on a long context
DECODE_METHOD = "ember decode: engine.step() loop, each token timestamped when its step returns"
RATES_METHOD = ("decode, both sides: mean = (N - 1) / (last token time - first token time); steady = 1 / median gap "
                "between tokens, robust to a burst of other work (bars use steady; on a quiet machine they agree)")
TTFT_METHOD = "ember TTFT: engine.add_request() to the step that returns the first token (max_tokens=1)"


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
                assert not (fresh and out.num_cached_tokens), \
                    "the prefix cache served a benchmark prompt; prompts must be fresh"
                times += [now] * (len(out.outputs[0].token_ids) - len(times))
    return times


def _run_one(engine, request_id: str, prompt: list[int], max_tokens: int, fresh: bool = True) -> list[float]:
    """One greedy request of exactly max_tokens tokens (EOS ignored): its token arrival times."""
    times = token_times(engine, request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                    ignore_eos=True), fresh)
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


def decode_metric_name(n: int, steady: bool) -> str:
    return f"batch-1 decode, {n} tokens, {'steady (median gap)' if steady else 'mean'}"


def ttft_metric_name(length: int) -> str:
    return f"TTFT, {length}-token prompt"


def bars(decode_tokens: int, prompt_lens: list[int]) -> list[Bar]:
    out = [Bar("batch-1 decode >= 2x transformers bf16", decode_metric_name(decode_tokens, steady=True), 2.0)]
    if 2048 in prompt_lens:
        # TTFT is lower-is-better; its speedup is peer time / ember time, so "no worse" is >= 1
        out.append(Bar("TTFT at 2048 tokens no worse than transformers bf16", ttft_metric_name(2048), 1.0))
    return out


def run(llm, peer, *, decode_tokens: int, prompt_lens: list[int], runs: int, quiet_wait_s: float = 0.0,
        prompt_seed_base: int = 0) -> list[Metric]:
    """One warmup round, then `runs` rounds; each round measures ember and the peer on the same
    freshly seeded prompts (a new prompt per round, so the prefix cache cannot help)."""
    engine = llm.engine
    make = prompt_maker(llm, prompt_seed_base)
    mean = Metric(decode_metric_name(decode_tokens, False), "tok/s", True, peer=[] if peer else None)
    steady = Metric(decode_metric_name(decode_tokens, True), "tok/s", True, peer=[] if peer else None)
    ttfts = {n: Metric(ttft_metric_name(n), "ms", False, peer=[] if peer else None) for n in prompt_lens}

    def decode(times: list[float]) -> dict:
        m, s = decode_rates(times)
        return {mean.name: m, steady.name: s}

    by_name = {m.name: m for m in (mean, steady, *ttfts.values())}
    for r in tqdm(range(-1, runs), desc="bench latency", unit="run", dynamic_ncols=True):
        label = "warmup" if r < 0 else f"run {r + 1}/{runs}"

        def decode_pair(attempt: int):
            p = make.make(1, DECODE_PROMPT_LEN, prompt_seed(r, attempt))[0]
            return (lambda: decode(ember_decode(engine, f"bench-decode-{r}-{attempt}", p, decode_tokens)),
                    (lambda: decode(peer.decode(p, decode_tokens))) if peer else None)

        def ttft_pair(n: int, m: Metric):
            def make_pair(attempt: int):
                p = make.make(1, n, prompt_seed(r, attempt, salt=n))[0]
                return (lambda: {m.name: 1000 * ember_ttft(engine, f"bench-ttft-{r}-{n}-{attempt}", p)},
                        (lambda: {m.name: 1000 * peer.ttft(p)}) if peer else None)
            return make_pair

        for make_pair in [decode_pair, *(ttft_pair(n, m) for n, m in ttfts.items())]:
            for side, values, others in measure_pair(r, make_pair, quiet_wait_s):
                for name, value in values.items():
                    m = by_name[name]
                    logger.info("bench latency %s %s: %s = %.1f %s (others used %s cores)", side, label, name, value,
                                m.unit, others)
                    if r >= 0:
                        m.add(side, value, others)
    return [mean, steady, *ttfts.values()]
