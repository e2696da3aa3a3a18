"""How figures read in the results' markdown: numbers, spreads, descriptions, table rows."""
from __future__ import annotations


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def describe(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"
