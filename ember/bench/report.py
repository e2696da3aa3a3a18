"""Benchmark results: metrics, bars, the machine they ran on, and the files they are written to.

One markdown file (benchmarks/cpu.md by default) holds one section per benchmark kind, fenced by
HTML comments, so `ember bench latency` and `ember bench throughput` each rewrite only their own
section. Next to it goes a JSON file per kind with every raw run, for tables generated later.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


# A measurement during which other processes kept more than this many cores busy is "contended".
CONTENDED_CORES = 0.5


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
    # cores other processes kept busy during each measurement (see OthersLoad), same order as the values
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

    def _kept(self, values: list) -> list:
        return [values[i] for i in self.kept_runs if i < len(values)]

    @property
    def ember_median(self) -> float:
        return statistics.median(self._kept(self.ember))

    @property
    def peer_median(self) -> float | None:
        return statistics.median(self._kept(self.peer)) if self.peer else None

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
        return statistics.median(self._kept(s)) if s else None


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


@dataclass
class Result:
    kind: str  # "latency" | "throughput": names the markdown section and the JSON file
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


# -- how busy the shared machine is -------------------------------------------------------------

def _busy_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - v[4]  # everything but idle and iowait


def _own_ticks(pids: tuple[int, ...] = ()) -> int | None:
    """CPU ticks of this process and of `pids` (benchmark workers whose work is ours too)."""
    total = 0
    for pid in ("self", *pids):
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += int(rest[11]) + int(rest[12])  # utime + stime, all its threads
    return total


class OthersLoad:
    """Cores that other processes kept busy while the `with` block ran (Linux /proc; None elsewhere).

    Wall times on a shared 2-core machine swing by 10x when someone else's job runs, so every
    measurement records this next to its value, and the report shows it."""

    cores: float | None = None

    def __init__(self, pids: tuple[int, ...] = ()):
        self.pids = tuple(pids)  # worker processes measuring for us: their CPU is not "others"

    def __enter__(self) -> "OthersLoad":
        self._t, self._busy, self._own = time.perf_counter(), _busy_ticks(), _own_ticks(self.pids)
        return self

    def __exit__(self, *exc) -> None:
        busy, own = _busy_ticks(), _own_ticks(self.pids)
        if None in (busy, own, self._busy, self._own):
            return
        seconds = max(time.perf_counter() - self._t, 1e-6)
        others = (busy - self._busy) - (own - self._own)
        self.cores = round(max(0.0, others / os.sysconf("SC_CLK_TCK") / seconds), 2)


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.25, sample_s: float = 1.0) -> float | None:
    """Wait (up to max_wait_s) until other processes use under `threshold_cores`; returns the last
    sample. A best effort: on a machine that never goes quiet it just costs max_wait_s."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        with OthersLoad() as load:
            time.sleep(sample_s)
        if load.cores is None or load.cores < threshold_cores or time.perf_counter() >= deadline:
            return load.cores


# -- the machine --------------------------------------------------------------------------------

def _cpuinfo_field(name: str) -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(name):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def machine_info() -> dict:
    import torch

    flags = (_cpuinfo_field("flags") or "").split()
    return {
        "cpu": _cpuinfo_field("model name") or platform.processor() or "unknown",
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gib": round(_ram_gib() or 0.0, 1),
        "avx512_bf16": "avx512_bf16" in flags,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "ember": _version("ember") or "source",
        "ember_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "load_at_end": load_average(),
    }


def load_average() -> float | None:
    """1-minute load average: above the core count means other processes shared the cores."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _machine_line(m: dict) -> str:
    bf16 = ", AVX512-BF16" if m["avx512_bf16"] else ""
    commit = f" @ {m['ember_commit']}" if m.get("ember_commit") else ""
    return (f"{m['cpu']} ({m['usable_cores']} cores{bf16}), {m['ram_gib']} GiB RAM, {m['os']}; "
            f"Python {m['python']}, torch {m['torch']}, transformers {m['transformers'] or '-'}, "
            f"ember {m['ember']}{commit}; {m['torch_threads']} torch threads; {m['date']}")


# -- rendering --------------------------------------------------------------------------------

def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def _load(values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f}" if known else "-"


def _describe(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def render_section(r: Result) -> str:
    peer_name = r.peer["name"] if r.peer else "peer"
    lines = [f"## {r.title}", "",
             f"- command: `{r.command}`",
             f"- machine: {_machine_line(r.machine)}",
             f"- 1-minute load average: {r.load_at_start if r.load_at_start is not None else '-'} at start, "
             f"{r.machine.get('load_at_end', '-')} at end ({r.machine['usable_cores']} cores; more means the cores "
             "were shared with other work and wall times are noisy)",
             f"- ember: {_describe(r.ember)}",
             f"- peer: {_describe(r.peer) if r.peer else 'none (--peer none)'}",
             f"- median of {r.runs} run(s) after 1 warmup; ember and peer alternate within each run, "
             f"and the speedup is the median of the per-run ratios (> 1 = ember better); \"runs used\" leaves out runs "
             f"during which other processes kept > {CONTENDED_CORES} cores busy (all runs are kept if every one was)"]
    lines += [f"- {n}" for n in r.notes]
    lines += ["", f"| metric | ember | {peer_name} | ember speedup | runs used | others' CPU use, cores (ember / {peer_name}) |",
              "|---|---:|---:|---:|---:|---:|"]
    for m in r.metrics:
        s = f"{m.speedup:.2f}x" if m.speedup is not None else "-"
        others = f"{_load(m._kept(m.ember_others))} / {_load(m._kept(m.peer_others))}"
        used = f"{len(m.kept_runs)}/{len(m.ember)}"
        lines.append(f"| {m.name} ({m.unit}) | {_fmt(m.ember_median)} | {_fmt(m.peer_median)} | {s} | {used} | {others} |")
    if r.bars:
        lines += ["", "| bar | measured | result |", "|---|---:|---|"]
        for b in r.bars:
            got, verdict = b.judge(r.metrics)
            lines.append(f"| {b.text} | {f'{got:.2f}x' if got is not None else '-'} | **{verdict}** |")
    return "\n".join(lines) + "\n"


def to_json(r: Result) -> dict:
    metrics = []
    for m in r.metrics:
        d = asdict(m)
        d.update(kept_runs=m.kept_runs, ember_median=m.ember_median, peer_median=m.peer_median, speedups=m.speedups,
                 speedup=m.speedup)
        metrics.append(d)
    bars = []
    for b in r.bars:
        got, verdict = b.judge(r.metrics)
        bars.append({**asdict(b), "speedup": got, "result": verdict})
    return {"kind": r.kind, "title": r.title, "command": r.command, "runs": r.runs, "machine": r.machine,
            "ember": r.ember, "peer": r.peer, "notes": r.notes, "load_at_start": r.load_at_start, "metrics": metrics, "bars": bars}


# -- files --------------------------------------------------------------------------------------

HEADER = ("# ember CPU benchmarks\n\n"
          "Written by `ember bench ...`; each section is rewritten only by its own command. "
          "Raw runs are in the JSON files next to this one.\n")


def _fence(kind: str) -> tuple[str, str]:
    return f"<!-- ember-bench:{kind}:begin -->", f"<!-- ember-bench:{kind}:end -->"


def update_markdown(text: str, kind: str, section: str) -> str:
    """`text` with the section of `kind` replaced (or appended when it is not there yet)."""
    begin, end = _fence(kind)
    block = f"{begin}\n{section}{end}\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    return text.rstrip("\n") + "\n\n" + block


def json_path(md_path: str | os.PathLike, kind: str) -> Path:
    p = Path(md_path)
    return p.with_name(f"{p.stem}-{kind}.json")


def write(r: Result, md_path: str | os.PathLike) -> tuple[Path, Path]:
    """Rewrite this result's section of the markdown file and its JSON file; return both paths."""
    md = Path(md_path)
    md.parent.mkdir(parents=True, exist_ok=True)
    old = md.read_text() if md.exists() else HEADER
    md.write_text(update_markdown(old, r.kind, render_section(r)))
    js = json_path(md, r.kind)
    js.write_text(json.dumps(to_json(r), indent=2) + "\n")
    return md, js
