"""`ember bench startup`: how soon a server answers after it is started, ember against llama-server.

For each side, each start: launch the server, time until /health answers 200, then send one
streamed chat request and time until its first token arrives (both from the moment of launch);
ember also reports when its background compile (--executor auto on CPU) finished. The first
ember start runs on an empty inductor cache of its own (TORCHINDUCTOR_CACHE_DIR in a fresh
folder: what a fresh install has; the C++ kernels are built at install), the next --runs starts
on the cache it filled ("warm"). llama.cpp's own `llama-server` binary (--llama-server, or on
PATH) runs the same file with the same thread count; its first start is its cold one (it keeps
no cache; the model file may already be in the OS page cache for both). Rounds alternate the
sides' order. A start is stopped (SIGTERM) before the next one begins.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile

from ember.bench.lib.args import add_benchmark_group, command_line
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import row
from ember.bench.lib.result import Result
from ember.bench.lib.servers import Server, ember_start, free_port, launch_plan, llama_server_start
from ember.errors import ConfigError

logger = logging.getLogger("ember.bench")

NAME = KIND = "startup"
HELP = "launch to /health 200 and to the first token, cold and warm, against llama.cpp's llama-server on the same file"
TITLE = "Start-up: launch to /health 200 and to the first token"


def measure(start: Server, timeout: float, wait_compile: bool) -> dict:
    try:
        health = start.health(timeout)
        first = start.first_token()
        compiled = start.compiled(timeout) if wait_compile else None
        return {
            "health_s": round(health, 2),
            "first_token_s": round(first, 2),
            "compiled_s": None if compiled is None else round(compiled, 1),
        }
    finally:
        start.stop()


def main(args) -> None:
    model, flags, threads = launch_plan(args)
    binary = None
    if args.peer == "llama-server":
        binary = args.llama_server or shutil.which("llama-server")
        if not binary or not os.access(binary, os.X_OK):
            raise ConfigError(
                "--peer llama-server needs llama.cpp's llama-server binary: pass --llama-server PATH "
                "(build it from llama.cpp: cmake -B build && cmake --build build --target llama-server), "
                "or --peer none"
            )
    cache_dir = tempfile.mkdtemp(prefix="ember-bench-inductor-")
    runs: dict[str, dict[str, list[dict]]] = {"ember": {"cold": [], "warm": []}}
    if binary:
        runs["llama-server"] = {"cold": [], "warm": []}
    load = load_average()
    try:
        for r in range(args.runs + 1):
            phase = "cold" if r == 0 else "warm"
            order = ["ember", "llama-server"] if r % 2 == 0 else ["llama-server", "ember"]
            for side in order:
                if side not in runs:
                    continue
                port = free_port()
                if side == "ember":
                    # each start waits for its compile to finish (--wait-compile): the warm ones then find its graphs
                    start = ember_start(flags, cache_dir, port)
                    result = measure(start, args.timeout, wait_compile=args.wait_compile)
                else:
                    result = measure(llama_server_start(binary, model, threads, port), args.timeout, False)
                runs[side][phase].append(result)
                logger.info("bench startup: %s %s start %d: %s", side, phase, r, result)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    command = command_line(args, ["runs", "peer", "output", "timeout"]) + (
        "" if args.wait_compile else " --no-wait-compile"
    )
    summary = summarize(runs)
    about = [
        f"model: `{model}`; {threads} threads; one streamed chat request of 16 tokens after /health",
        "cold: ember's first start on an empty inductor cache (TORCHINDUCTOR_CACHE_DIR in a fresh folder; the C++ "
        "kernels were built at install); llama-server's first start. warm: the next starts (median [min-max])",
        "ember compiled: launch to the end of its background compile (--executor auto on CPU; requests are "
        "served eagerly until then)",
    ]
    Result(
        KIND,
        TITLE,
        command,
        load,
        about,
        [],
        table(summary),
        {"threads": threads, "model": model, "runs": runs, "summary": summary},
    ).publish(args.output)


def summarize(runs: dict) -> dict:
    out = {}
    for side, phases in runs.items():
        for phase, results in phases.items():
            for key in ("health_s", "first_token_s", "compiled_s"):
                vals = [r[key] for r in results if r.get(key) is not None]
                if vals:
                    out.setdefault(side, {}).setdefault(phase, {})[key] = {
                        "median": round(statistics.median(vals), 2),
                        "min": min(vals),
                        "max": max(vals),
                        "n": len(vals),
                    }
    return out


def _cell(s: dict | None) -> str:
    if not s:
        return "-"
    return f"{s['median']:.2f}" if s["n"] == 1 else f"{s['median']:.2f} [{s['min']:.2f}-{s['max']:.2f}]"


def table(summary: dict) -> list[str]:
    sides = list(summary)
    lines = [
        "| start | metric (s) | " + " | ".join(sides) + (" | ember / llama-server |" if len(sides) > 1 else " |"),
        "|---|---|" + "---:|" * (len(sides) + (1 if len(sides) > 1 else 0)),
    ]
    for phase in ("cold", "warm"):
        for key, label in (("health_s", "/health 200"), ("first_token_s", "first token"), ("compiled_s", "compiled")):
            cells = [summary.get(s, {}).get(phase, {}).get(key) for s in sides]
            if not any(cells):
                continue
            line = [phase, label, *(_cell(c) for c in cells)]
            if len(sides) > 1:
                a, b = cells[0], cells[1]
                line.append(f"{a['median'] / b['median']:.2f}x" if a and b and b["median"] else "-")
            lines.append(row(line))
    return lines


def add_cli_args(p) -> None:
    g = add_benchmark_group(p)
    g.add_argument("--runs", type=int, default=3, help="warm starts per side after the cold one")
    g.add_argument("--peer", choices=["llama-server", "none"], default="llama-server")
    g.add_argument(
        "--llama-server", default=None, metavar="PATH", help="llama.cpp's llama-server binary (default: on PATH)"
    )
    g.add_argument(
        "--wait-compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the first token, wait for ember's background compile and report when it finished",
    )
    g.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        help="seconds a start may take, its background compile included (a cold one took over 15 min on 2 Zen3 cores)",
    )
    g.add_argument("--output", default="benchmarks/startup.md", help="markdown file; the JSON goes beside it")
