"""A benchmark result measured on ember and its peer in the same runs: metrics, the bars judged on
them, what each side ran, the machine, and the result's markdown section and JSON file (lib/files.py).

`ember bench latency | throughput | structured` report through it.
"""
from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from ember.bench.lib.cpu import CONTENDED_CORES
from ember.bench.lib.files import publish
from ember.bench.lib.machine import machine_info
from ember.bench.lib.markdown import describe, fmt, head


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


@dataclass
class Bar:
    """A target: ember's speedup on `metric` must be at least `min_speedup`."""

    text: str
    metric: str
    min_speedup: float

    def judge(self, metrics: list[Metric]) -> tuple[float | None, str]:
        m = next((m for m in metrics if m.name == self.metric), None)
        if m is None:
            return None, "n/a (not measured)"
        if m.speedup is None:
            return None, "n/a (no peer)"
        return m.speedup, "PASS" if m.speedup >= self.min_speedup else "FAIL"


def _load(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f}" if known else "-"


@dataclass
class Result:
    kind: str  # names the markdown section and the JSON file: "latency", "throughput", ...
    title: str
    command: str
    runs: int
    metrics: list[Metric]
    bars: list[Bar]
    ember: dict  # what ember ran: model, dtype, effective knobs
    peer: dict | None  # what the peer ran, None with --peer none
    notes: list[str] = field(default_factory=list)  # how each figure is measured
    load_at_start: float | None = None  # 1-minute load average when the benchmark began
    machine: dict = field(default_factory=lambda: machine_info())

    def to_markdown(self) -> str:
        peer_name = self.peer["name"] if self.peer else "peer"
        lines = head(self.title, self.command, self.machine, self.load_at_start, cores_note=True)
        lines += [f"- ember: {describe(self.ember)}",
                  f"- peer: {describe(self.peer) if self.peer else 'none (--peer none)'}",
                  f"- median of {self.runs} run(s) after 1 warmup; ember and peer alternate within each run, "
                  f"and the speedup is the median of the per-run ratios (> 1 = ember better); \"runs used\" leaves out "
                  f"runs during which other processes kept > {CONTENDED_CORES} cores busy (all runs are kept if every "
                  "one was)"]
        lines += [f"- {n}" for n in self.notes]
        lines += ["", f"| metric | ember | {peer_name} | ember speedup | runs used | others' CPU use, cores (ember / "
                      f"{peer_name}) |", "|---|---:|---:|---:|---:|---:|"]
        for m in self.metrics:
            s = f"{m.speedup:.2f}x" if m.speedup is not None else "-"
            others = f"{_load(m.kept(m.ember_others))} / {_load(m.kept(m.peer_others))}"
            used = f"{len(m.kept_runs)}/{len(m.ember)}"
            lines.append(f"| {m.name} ({m.unit}) | {fmt(m.ember_median)} | {fmt(m.peer_median)} | {s} | {used} | "
                         f"{others} |")
        if self.bars:
            lines += ["", "| bar | measured | result |", "|---|---:|---|"]
            for b in self.bars:
                got, verdict = b.judge(self.metrics)
                lines.append(f"| {b.text} | {f'{got:.2f}x' if got is not None else '-'} | **{verdict}** |")
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        metrics = []
        for m in self.metrics:
            d = asdict(m)
            d.update(kept_runs=m.kept_runs, ember_median=m.ember_median, peer_median=m.peer_median,
                     speedups=m.speedups, speedup=m.speedup)
            metrics.append(d)
        bars = []
        for b in self.bars:
            got, verdict = b.judge(self.metrics)
            bars.append({**asdict(b), "speedup": got, "result": verdict})
        return {"kind": self.kind, "title": self.title, "command": self.command, "runs": self.runs,
                "machine": self.machine, "ember": self.ember, "peer": self.peer, "notes": self.notes,
                "load_at_start": self.load_at_start, "metrics": metrics, "bars": bars}

    def publish(self, md_path: str) -> None:
        """Rewrite this result's section of the markdown file and its JSON file, and print the section."""
        publish(md_path, self.kind, self.to_markdown(), self.to_json())
