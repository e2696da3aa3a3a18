"""Figures measured on ember and its peer in the same runs, the shape of `ember bench latency | throughput |
structured`: a Metric per figure, the runs that fill them, a bar on ember's speedup over the peer, and the
Result that reports them.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

from tqdm import tqdm

from ember.bench.lib.bar import Bar
from ember.bench.lib.cpu import CONTENDED_CORES, measure_pair
from ember.bench.lib.markdown import cores_cell, describe, fmt
from ember.bench.lib.result import Result

logger = logging.getLogger("ember.bench")


@dataclass
class Metric:
    """One measured quantity: a value per run for ember and (when there is one) for the peer.

    Summaries (medians, speedup) use only the runs where neither side was contended, as long as
    there is one; a 2-core machine shared with other jobs otherwise reports their load, not ours.
    """

    name: str
    unit: str
    higher_is_better: bool
    ember: list[float] = field(default_factory=list)
    peer: list[float] | None = None
    # cores other processes kept busy during each measurement (see CpuMeter), same order as the values
    ember_others: list[float | None] = field(default_factory=list)
    peer_others: list[float | None] = field(default_factory=list)

    def add(self, side: str, value: float, others: float | None) -> None:
        (self.ember if side == "ember" else self.peer).append(value)
        (self.ember_others if side == "ember" else self.peer_others).append(others)

    @property
    def kept_runs(self) -> list[int]:
        """Indices of the runs the summaries use: the uncontended ones, or all when none is."""

        def quiet(others: list[float | None], i: int) -> bool:
            return i >= len(others) or others[i] is None or others[i] <= CONTENDED_CORES

        runs = range(len(self.ember))
        clean = [i for i in runs if quiet(self.ember_others, i) and (self.peer is None or quiet(self.peer_others, i))]
        return clean or list(runs)

    def kept(self, values: list) -> list:
        return [values[i] for i in self.kept_runs if i < len(values)]

    @property
    def ember_median(self) -> float:
        return statistics.median(self.kept(self.ember))

    @property
    def peer_median(self) -> float | None:
        return statistics.median(self.kept(self.peer)) if self.peer else None

    @property
    def speedups(self) -> list[float] | None:
        """Per-run ember speedup over the peer measured in the same run (> 1 = ember better).

        Pairing by run cancels most of the shared machine's drift; the reported figure is the
        median of these, not the ratio of the two medians."""
        if not self.peer:
            return None
        if self.higher_is_better:
            return [e / p for e, p in zip(self.ember, self.peer)]
        return [p / e for e, p in zip(self.ember, self.peer)]

    @property
    def speedup(self) -> float | None:
        s = self.speedups
        return statistics.median(self.kept(s)) if s else None

    def to_json(self) -> dict:
        return {
            **asdict(self),
            "kept_runs": self.kept_runs,
            "ember_median": self.ember_median,
            "peer_median": self.peer_median,
            "speedups": self.speedups,
            "speedup": self.speedup,
        }


def measure_runs(
    desc: str, runs: int, pairs: Callable[[int], list], metrics: list[Metric], quiet_wait_s: float
) -> None:
    """One warmup round (-1), then `runs` rounds; pairs(round) gives the round's measurements, each a
    make_pair of cpu.measure_pair whose sides return {metric name: value}. Every value goes to its metric
    (other keys are only logged), the warmup's excepted."""
    by_name = {m.name: m for m in metrics}
    for r in tqdm(range(-1, runs), desc=desc, unit="run", dynamic_ncols=True):
        for make_pair in pairs(r):
            for side, values, others in measure_pair(r, make_pair, quiet_wait_s):
                logger.info(
                    "%s %s %s: %s (others used %s cores)",
                    desc,
                    side,
                    "warmup" if r < 0 else f"run {r + 1}/{runs}",
                    ", ".join(f"{name} = {v:.2f}" for name, v in values.items()),
                    others,
                )
                for name, value in values.items():
                    if r >= 0 and name in by_name:
                        by_name[name].add(side, value, others)


def speedup_bar(text: str, metrics: list[Metric], name: str, min_speedup: float) -> Bar:
    """ember's speedup on the metric called `name` must be at least `min_speedup`."""
    m = next((m for m in metrics if m.name == name), None)
    return Bar(
        text,
        ">=",
        min_speedup,
        m.speedup if m else None,
        missing="no peer" if m else "not measured",
        on={"metric": name},
    )


def paired_result(
    kind: str,
    title: str,
    command: str,
    runs: int,
    metrics: list[Metric],
    bars: list[Bar],
    ember: dict,
    peer: dict | None,
    notes: list[str],
    load_at_start: float | None,
) -> Result:
    """The Result of metrics measured on ember and its peer (`peer` None with --peer none): what each side
    ran (dicts), a row per metric, the bars."""
    peer_name = peer["name"] if peer else "peer"
    about = [
        f"ember: {describe(ember)}",
        f"peer: {describe(peer) if peer else 'none (--peer none)'}",
        f"median of {runs} run(s) after 1 warmup; ember and peer alternate within each run, and the speedup is "
        f'the median of the per-run ratios (> 1 = ember better); "runs used" leaves out runs during which '
        f"other processes kept > {CONTENDED_CORES} cores busy (all runs are kept if every one was)",
    ]
    table = [
        f"| metric | ember | {peer_name} | ember speedup | runs used | others' CPU use, cores (ember / {peer_name}) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in metrics:
        s = f"{m.speedup:.2f}x" if m.speedup is not None else "-"
        table.append(
            f"| {m.name} ({m.unit}) | {fmt(m.ember_median)} | {fmt(m.peer_median)} | {s} | "
            f"{len(m.kept_runs)}/{len(m.ember)} | {cores_cell(m.kept(m.ember_others))} / "
            f"{cores_cell(m.kept(m.peer_others))} |"
        )
    data = {"runs": runs, "ember": ember, "peer": peer, "metrics": [m.to_json() for m in metrics]}
    return Result(kind, title, command, load_at_start, about, notes, table, data, bars)
