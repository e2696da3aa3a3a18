"""CPU use on a shared machine: one meter of the cores this process (with its workers), a server and
everyone else used while a block ran; waiting for the machine to go quiet; and the paired protocol that
redoes a measurement others disturbed.

Wall times on a shared 2-core machine swing by 10x when someone else's job runs, so every measurement
records what other processes used next to its value, and the report shows it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

logger = logging.getLogger("ember.bench")

# A measurement during which other processes kept more than this many cores busy is "contended".
CONTENDED_CORES = 0.5
RETRIES = 2  # a pair measured while others kept > CONTENDED_CORES busy is redone up to this often


def _busy_ticks() -> int | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return sum(v) - v[3] - v[4]  # everything but idle and iowait


def _ticks(pids: tuple) -> int | None:
    """CPU ticks of these processes ("self" is this one), all their threads; None when one cannot be read."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                rest = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += int(rest[11]) + int(rest[12])  # utime + stime
    return total


class CpuMeter:
    """Cores used while the `with` block ran (Linux /proc; None elsewhere): `own` by this process and
    `pids` (benchmark workers whose work is ours too), `server` by the server process when its pid is
    known, `others` by every other process."""

    own: float | None = None
    server: float | None = None
    others: float | None = None

    def __init__(self, pids: tuple[int, ...] = (), server_pid: int | None = None):
        self.pids, self.server_pid = tuple(pids), server_pid

    def _read(self) -> tuple:
        srv = _ticks((self.server_pid,)) if self.server_pid is not None else None
        return _busy_ticks(), _ticks(("self", *self.pids)), srv

    def __enter__(self) -> "CpuMeter":
        self._t = time.perf_counter()
        self._busy, self._own, self._srv = self._read()
        return self

    def __exit__(self, *exc) -> None:
        busy, own, srv = self._read()
        if None in (busy, own, self._busy, self._own):
            return
        hz, seconds = os.sysconf("SC_CLK_TCK"), max(time.perf_counter() - self._t, 1e-6)
        d_own = own - self._own
        d_srv = (srv - self._srv) if srv is not None and self._srv is not None else 0
        self.own = round(d_own / hz / seconds, 2)
        self.server = round(d_srv / hz / seconds, 2) if self.server_pid else None
        self.others = round(max(0.0, (busy - self._busy - d_own - d_srv) / hz / seconds), 2)

    def to_dict(self) -> dict:
        return {"client": self.own, "server": self.server, "others": self.others}


def wait_for_quiet(max_wait_s: float, threshold_cores: float = 0.25, sample_s: float = 1.0) -> float | None:
    """Wait (up to max_wait_s) until other processes use under `threshold_cores`; returns the last
    sample. A best effort: on a machine that never goes quiet it just costs max_wait_s."""
    deadline = time.perf_counter() + max_wait_s
    while True:
        with CpuMeter() as load:
            time.sleep(sample_s)
        if load.others is None or load.others < threshold_cores or time.perf_counter() >= deadline:
            return load.others


def measure_pair(
    run: int, make_pair: Callable[[int], tuple[Callable[[], dict], Callable[[], dict] | None]], quiet_wait_s: float
) -> list[tuple[str, dict, float | None]]:
    """Run ember and the peer back to back; [(side, values, others' cores)].

    `make_pair(attempt)` gives the two measurements on that attempt's inputs: a redone pair must
    get fresh prompts, or ember's prefix cache would serve the prompt it has just seen. For
    measured runs (run >= 0): first wait for the machine to go quiet, and redo the pair (up to
    RETRIES times) when someone else's job took over half a core during either side. Who goes
    first alternates by run, so drift on the shared machine favours neither side."""
    for attempt in range(RETRIES + 1):
        ember_fn, peer_fn = make_pair(attempt)
        sides = [("ember", ember_fn)] + ([("peer", peer_fn)] if peer_fn else [])
        if run % 2:
            sides.reverse()
        if run >= 0 and quiet_wait_s > 0:
            wait_for_quiet(quiet_wait_s)
        out = []
        for side, fn in sides:
            with CpuMeter() as load:
                values = fn()
            out.append((side, values, load.others))
        worst = max((o or 0.0) for _, _, o in out)
        if run < 0 or worst <= CONTENDED_CORES or attempt == RETRIES:
            return out
        logger.info("bench: other processes used %.2f cores during a measurement; measuring the pair again", worst)
    return out


def protocol_note(quiet_wait: float) -> str:
    """measure_pair's protocol, as the results file states it."""
    return (
        f"before each measured pair: wait up to {quiet_wait:g}s for other processes to leave the CPU idle; "
        f"a pair during which they used > {CONTENDED_CORES} cores is redone (up to {RETRIES} times)"
    )
