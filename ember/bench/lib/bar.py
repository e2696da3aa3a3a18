"""A bar: a target on one figure of a benchmark (the figure must be >=, >, <=, < or within a threshold),
judged PASS or FAIL, or n/a when the figure was not measured; and the one table every results file
shows its bars in.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

# how a measured value meets its threshold; "within": a ratio no further than `threshold` from 1
OPS = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "<": operator.lt,
    "within": lambda value, threshold: abs(value - 1) <= threshold,
}


@dataclass
class Bar:
    text: str
    op: str  # one of OPS
    threshold: float
    measured: float | None = None  # None: not measured, and the verdict is n/a
    spread: tuple[float, float] | None = None  # (min, max) of the measured value over the runs
    shown: str | None = None  # how the table shows the measured value (default: a ratio, "1.23x [1.10-1.31]")
    missing: str = "not measured"  # why there is no measured value
    unmet: bool = False  # failed whatever the value says (e.g. requests failed, so their TTFT says little)
    on: dict = field(default_factory=dict)  # which figure it judges, in the command's words (for the JSON)

    @property
    def result(self) -> str:
        if self.unmet:
            return "FAIL"
        if self.measured is None:
            return f"n/a ({self.missing})"
        return "PASS" if OPS[self.op](self.measured, self.threshold) else "FAIL"

    @property
    def cell(self) -> str:
        if self.shown is not None:
            return self.shown
        if self.measured is None:
            return "-"
        if self.spread is None:
            return f"{self.measured:.2f}x"
        return f"{self.measured:.2f}x [{self.spread[0]:.2f}-{self.spread[1]:.2f}]"

    def to_json(self) -> dict:
        out = {"text": self.text, **self.on, "op": self.op, "threshold": self.threshold, "measured": self.measured}
        if self.spread is not None:
            out["measured_min"], out["measured_max"] = self.spread
        return {**out, "shown": self.cell, "result": self.result}


def bar_table(bars: list[Bar], column: str = "measured") -> list[str]:
    """The verdicts as a markdown table; `column` names what the measured values are."""
    return [f"| bar | {column} | result |", "|---|---:|---|"] + [
        f"| {b.text} | {b.cell} | **{b.result}** |" for b in bars
    ]
