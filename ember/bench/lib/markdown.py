"""How figures read in the results' markdown: numbers, spreads, ratios, descriptions, table rows."""

from __future__ import annotations

import statistics
from typing import Callable


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def describe(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def cell(s: dict | None, suffix: str = "", number: Callable[[float], str] = fmt) -> str:
    """'median [min-max]' of a spread (lib/rounds.py), each written by `number`, or '-'."""
    if not s or "median" not in s:
        return "-"
    return f"{number(s['median'])}{suffix} [{number(s['min'])}-{number(s['max'])}]"


def ratio_cell(r: dict | None) -> str:
    """'1.23x [1.10-1.31]' of paired ratios, or '-'."""
    return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"


def cores_cell(values: list[float | None]) -> str:
    """The median of the cores other processes used (CpuMeter), the unknown left out, or '-'."""
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.2f}" if known else "-"
