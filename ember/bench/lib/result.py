"""One benchmark's result: its section of a markdown results file and its JSON file (lib/files.py).

Every command reports through it. A section starts with the same head (the title, the command that
reproduces the run, the machine, the load on it), then what ran and how each figure was measured, one
bullet each, then the command's own table, then its bars (lib/bar.py). The JSON file holds the same
with the command's raw figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ember.bench.lib.bar import Bar, bar_table
from ember.bench.lib.files import HEADER, publish
from ember.bench.lib.machine import machine_info, machine_line


@dataclass
class Result:
    kind: str  # names the markdown section and the JSON file: "latency", "compare", "serve:ember", ...
    title: str
    command: str  # the command line that reproduces the run
    load_at_start: float | None  # 1-minute load average when the benchmark began
    about: list[str]  # what ran, one bullet each (the JSON has it in `data`)
    notes: list[str]  # how each figure was measured
    table: list[str]  # the command's own markdown: its table, and any paragraph under it
    data: dict  # the command's figures and what ran, for the JSON file
    bars: list[Bar] = field(default_factory=list)
    bar_column: str = "measured"  # what the bars' measured values are
    machine: dict = field(default_factory=lambda: machine_info())  # looked up when called: tests swap it

    def to_markdown(self) -> str:
        m = self.machine
        load = "-" if self.load_at_start is None else self.load_at_start
        lines = [
            f"## {self.title}",
            "",
            f"- command: `{self.command}`",
            f"- machine: {machine_line(m)}",
            f"- 1-minute load average: {load} at start, {m.get('load_at_end', '-')} at end ({m['usable_cores']} "
            "cores; more means the cores were shared with other work and wall times are noisy)",
        ]
        lines += [f"- {line}" for line in self.about + self.notes] + [""] + self.table
        if self.bars:
            lines += [""] + bar_table(self.bars, self.bar_column)
        return "\n".join(lines) + "\n"

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "title": self.title,
            "command": self.command,
            "machine": self.machine,
            "load_at_start": self.load_at_start,
            **self.data,
            "notes": self.notes,
            "bars": [b.to_json() for b in self.bars],
        }

    def publish(self, md_path: str | os.PathLike, *, header: str = HEADER, json_file: Path | None = None) -> None:
        """Rewrite this result's section of the markdown file and its JSON file, and print the section."""
        publish(md_path, self.kind, self.to_markdown(), self.to_json(), header=header, json_file=json_file)
