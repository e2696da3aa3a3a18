"""Batch-1 latency: greedy decode speed after the first token, and time to first token (TTFT).

Both are taken through the engine's step loop (add_request / step), the same path the server's
streaming uses, so TTFT includes scheduling and sampling, not just the forward.
"""
from __future__ import annotations

import logging
import time

from tqdm import tqdm

from ember.bench.report import Bar, Metric
from ember.bench.throughput import WARMUP_SEED, prompt_maker
from ember.sampling import SamplingParams

logger = logging.getLogger("ember.bench")

DECODE_PROMPT_LEN = 32  # "a short prompt": decode speed should not depend on a long context
DECODE_METHOD = ("ember decode: engine.step() loop, tok/s = (N - 1) / (last token time - first token time), "
                 "TTFT excluded")
TTFT_METHOD = "ember TTFT: engine.add_request() to the step that returns the first token (max_tokens=1)"


def _run_one(engine, request_id: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Drive one greedy request to the end; the perf_counter time each of its tokens arrived."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    times: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                now = time.perf_counter()
                times += [now] * (len(out.outputs[0].token_ids) - len(times))
    assert len(times) == max_tokens, f"ember produced {len(times)} tokens, wanted {max_tokens}"
    return times


def ember_decode(engine, request_id: str, prompt: list[int], n: int) -> float:
    times = _run_one(engine, request_id, prompt, n)
    return (n - 1) / (times[-1] - times[0])


def ember_ttft(engine, request_id: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    times = _run_one(engine, request_id, prompt, 1)
    return times[0] - t0


def decode_metric_name(n: int) -> str:
    return f"batch-1 decode, {n} tokens"


def ttft_metric_name(length: int) -> str:
    return f"TTFT, {length}-token prompt"


def bars(decode_tokens: int, prompt_lens: list[int]) -> list[Bar]:
    out = [Bar("batch-1 decode >= 2x transformers bf16", decode_metric_name(decode_tokens), 2.0)]
    if 2048 in prompt_lens:
        # TTFT is lower-is-better; its speedup is peer time / ember time, so "no worse" is >= 1
        out.append(Bar("TTFT at 2048 tokens no worse than transformers bf16", ttft_metric_name(2048), 1.0))
    return out


def run(llm, peer, *, decode_tokens: int, prompt_lens: list[int], runs: int) -> list[Metric]:
    """One warmup round, then `runs` rounds; each round measures ember and the peer on the same
    freshly seeded prompts (a new prompt per round, so the prefix cache cannot help)."""
    engine = llm.engine
    make = prompt_maker(llm)
    with_peer = peer is not None
    decode = Metric(decode_metric_name(decode_tokens), "tok/s", True, peer=[] if with_peer else None)
    ttfts = {n: Metric(ttft_metric_name(n), "ms", False, peer=[] if with_peer else None) for n in prompt_lens}
    for r in tqdm(range(-1, runs), desc="bench latency", unit="run", dynamic_ncols=True):
        seed = WARMUP_SEED if r < 0 else r
        label = "warmup" if r < 0 else f"run {r + 1}/{runs}"
        tasks = [(decode, make.make(1, DECODE_PROMPT_LEN, seed)[0],
                  lambda p, i: ember_decode(engine, f"bench-decode-{i}", p, decode_tokens),
                  lambda p: peer.decode(p, decode_tokens))]
        for n, metric in ttfts.items():
            tasks.append((metric, make.make(1, n, seed * 7919 + n)[0],
                          lambda p, i: 1000 * ember_ttft(engine, f"bench-ttft-{i}", p),
                          lambda p: 1000 * peer.ttft(p)))
        for metric, prompt, ember_fn, peer_fn in tasks:
            sides = [("ember", lambda: ember_fn(prompt, f"{r}-{len(prompt)}"))]
            if with_peer:
                sides.append(("peer", lambda: peer_fn(prompt)))
                if r % 2:  # alternate who goes first, so drift on the shared machine favours neither
                    sides.reverse()
            for side, measure in sides:
                value = measure()
                logger.info("bench latency %s %s: %s = %.1f %s", side, label, metric.name, value, metric.unit)
                if r >= 0:
                    (metric.ember if side == "ember" else metric.peer).append(value)
    return [decode, *ttfts.values()]
