"""How figures read in the results' markdown: numbers, table rows, and the head every section starts with
(its command, its machine, the load on it)."""
from __future__ import annotations

from ember.bench.lib.machine import machine_line


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v:.0f}" if abs(v) >= 1000 else f"{v:.3g}" if abs(v) < 10 else f"{v:.1f}"


def describe(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in d.items())


def row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def head(title: str, command: str, machine: dict, load_at_start: float | None, *,
         cores_note: bool = False) -> list[str]:
    """The section's title and its first lines. cores_note: say the machine's core count and what a load
    above it means (and write a missing load as '-')."""
    if cores_note:
        load = (f"{load_at_start if load_at_start is not None else '-'} at start, {machine.get('load_at_end', '-')} "
                f"at end ({machine['usable_cores']} cores; more means the cores were shared with other work and "
                "wall times are noisy)")
    else:
        load = f"{load_at_start} at start, {machine.get('load_at_end')} at end"
    return [f"## {title}", "", f"- command: `{command}`", f"- machine: {machine_line(machine)}",
            f"- 1-minute load average: {load}"]
