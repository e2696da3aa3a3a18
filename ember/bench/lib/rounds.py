"""Sides measured in rounds, the protocol of `ember bench compare | hybrid | matrix`: every side takes every
task on the same inputs in each round, the order of sides reversed every other round so drift favours
no one; figures are summarized as median [min-max], and ratios between two sides are taken round by
round (the same round's inputs and machine state), then summarized.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import statistics
from dataclasses import dataclass
from typing import Callable

from tqdm import tqdm

from ember.bench.lib import membw
from ember.bench.lib.bar import Bar
from ember.bench.lib.cpu import CpuMeter, wait_for_quiet
from ember.bench.lib.prompts import prompt_seed
from ember.bench.lib.timing import DECODE_PROMPT_LEN, decode_rates

logger = logging.getLogger("ember.bench")


@dataclass
class Figure:
    """One reported quantity."""

    key: str
    name: str
    unit: str
    higher_is_better: bool


@dataclass
class Task:
    """One measurement per side per round: inputs(round) are shared by all sides; measure(side,
    inputs) returns {figure key: value}. Sides named in `skip` do not take it."""

    figures: list[Figure]
    inputs: Callable[[int], object]
    measure: Callable[[object, object], dict]
    skip: frozenset = frozenset()


def _seed(run: int, salt: int) -> int:
    return prompt_seed(run, 0, salt)


def decode_task(maker, n: int, skip=frozenset(), prompt: Callable[[int], list[int]] | None = None) -> Task:
    """prompt: round -> the prompt every side decodes after (default: DECODE_PROMPT_LEN random tokens)."""
    figs = [
        Figure("decode", f"batch-1 decode, {n} tokens", "tok/s", True),
        Figure("decode_steady", f"batch-1 decode, {n} tokens, steady (median gap)", "tok/s", True),
    ]

    def measure(side, prompt):
        times = side.decode(prompt, n)
        assert len(times) == n, f"{len(times)} tokens, wanted {n}"
        mean, steady = decode_rates(times)
        return {"decode": mean, "decode_steady": steady}

    return Task(figs, prompt or (lambda r: maker.make(1, DECODE_PROMPT_LEN, _seed(r, 1))[0]), measure, skip)


def ttft_key(length: int) -> str:
    return f"ttft_{length}"


def ttft_task(maker, length: int, skip=frozenset()) -> Task:
    fig = Figure(ttft_key(length), f"TTFT, {length}-token prompt", "ms", False)
    return Task(
        [fig],
        lambda r: maker.make(1, length, _seed(r, length))[0],
        lambda side, prompt: {fig.key: 1000 * side.ttft(prompt)},
        skip,
    )


def throughput_prompts(maker, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """n prompts of lengths drawn uniformly from lo..hi (seeded), each its own random tokens."""
    rng = random.Random(seed)
    return [maker.make(1, rng.randint(lo, hi), seed * 1000 + i)[0] for i in range(n)]


def throughput_task(maker, n: int, lo: int, hi: int, output_len: int, skip=frozenset()) -> Task:
    fig = Figure("throughput", f"offline throughput, {n} prompts x {lo}-{hi} in / {output_len} out", "out tok/s", True)

    def measure(side, prompts):
        seconds, generated = side.batch(prompts, output_len)
        assert generated == n * output_len, f"{generated} tokens, wanted {n * output_len}"
        return {fig.key: generated / seconds}

    return Task([fig], lambda r: throughput_prompts(maker, n, lo, hi, _seed(r, 3)), measure, skip)


def measure(
    sides: dict, tasks: list[Task], *, runs: int, quiet_wait_s: float, bandwidth_mib: int = 0, desc: str = "bench"
) -> tuple[dict, list[float]]:
    """({figure key: {side: {"runs": [...], "others": [...]}}}, bandwidth GB/s per round).

    Round -1 is the warmup (compiles, caches, page faults), not recorded."""
    results: dict = {}
    for t in tasks:
        for f in t.figures:
            results[f.key] = {n: {"runs": [], "others": []} for n in sides if n not in t.skip}
    bandwidth: list[float] = []
    workers = tuple(s.pid for s in sides.values() if s.pid is not None)
    for r in tqdm(range(-1, runs), desc=desc, unit="round", dynamic_ncols=True):
        if r >= 0 and bandwidth_mib:
            bandwidth.append(membw.read_gbps(bandwidth_mib))
        for t in tasks:
            inputs = t.inputs(r)
            names = [n for n in sides if n not in t.skip]
            if r % 2:
                names.reverse()
            for n in names:
                if r >= 0 and quiet_wait_s > 0:
                    wait_for_quiet(quiet_wait_s)
                with CpuMeter(pids=workers) as load:
                    values = t.measure(sides[n], inputs)
                logger.info(
                    "%s %s %s: %s (others used %s cores)",
                    desc,
                    n,
                    "warmup" if r < 0 else f"round {r + 1}",
                    ", ".join(f"{k} {v:.1f}" for k, v in values.items()),
                    load.others,
                )
                if r >= 0:
                    for k, v in values.items():
                        results[k][n]["runs"].append(v)
                        results[k][n]["others"].append(load.others)
    return results, bandwidth


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)} if values else {}


def summarize_figures(figures: list[Figure], results: dict) -> list[dict]:
    out = []
    for f in figures:
        values = {n: {**s, **spread(s["runs"])} for n, s in results[f.key].items()}
        out.append({**dataclasses.asdict(f), "values": values})
    return out


def paired_ratios(figure: dict, side: str, peer: str) -> dict | None:
    """side / peer, round by round (the same round's inputs and machine state), summarized."""
    v = figure["values"]
    if side not in v or peer not in v or not v[side]["runs"] or not v[peer]["runs"]:
        return None
    runs = [e / p for e, p in zip(v[side]["runs"], v[peer]["runs"])]
    return {"runs": runs, **spread(runs)}


def ratio_bar(text: str, figures: list[dict], key: str, side: str, peer: str, op: str, threshold: float) -> Bar:
    """A bar on side / peer of the figure `key`, taken round by round (paired_ratios): its median must be
    `op` `threshold`."""
    fig = next((f for f in figures if f["key"] == key), None)
    r = paired_ratios(fig, side, peer) if fig else None
    return Bar(
        text,
        op,
        threshold,
        r["median"] if r else None,
        (r["min"], r["max"]) if r else None,
        missing=f"{side} or {peer} not measured",
        on={"figure": key, "side": side, "peer": peer},
    )
