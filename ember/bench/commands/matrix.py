"""`ember bench matrix`: what each engine lever buys on CPU, from everything off to everything on.

Rows, cumulative, each an engine of its own (a worker process each, so peak RSS is its own):
everything off (eager, no chunked prefill, no speculation, dense weights: --quantization none,
no int8 decode copy, no fused C++ decode attention) -> + int8 weight-only decode copy -> + packed
GGUF weights (--quantization auto, replacing both) -> + their dense copy for many-row steps ->
+ the tiled GEMV -> + its int8-activation path for many-row steps (which makes the copy moot) ->
+ the fused C++ decode attention -> + chunked prefill -> + MTP speculation -> + the compiled executor (only
when this build's EngineConfig has an `executor` field). Columns: TTFT at the longest prompt,
batch-1 decode tok/s, offline throughput, peak RSS; median [min-max] over rounds, the rows
alternating in order each round like the sides of `ember bench compare`.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging

from ember.bench.lib.args import add_common_args, add_workload_args, command_line, names, positive_int, switches
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import cell, fmt, row
from ember.bench.lib.prompts import prompt_maker_of
from ember.bench.lib.result import Result
from ember.bench.lib.rounds import decode_task, measure, summarize_figures, throughput_task, ttft_task
from ember.bench.sides.ember import EMBER, ember_knobs
from ember.bench.sides.worker import start_side

logger = logging.getLogger("ember.bench")

NAME = KIND = "matrix"
HELP = "each engine lever from everything off to everything on: TTFT, decode, throughput, peak memory"
TITLE = "Engine levers (ember alone, cumulative)"
OFF = {
    "enforce_eager": True,
    "enable_chunked_prefill": False,
    "enable_mtp": False,
    "speculative_config": None,
    "speculative_model": None,
    "num_speculative_tokens": None,
    "quantization": "none",
    "int8_decode": False,
    "int4_dense_copy": False,
    "cpu_tiled_gemv": False,
    "cpu_paged_attention": False,
    "cpu_fused_elementwise": False,
    "cpu_flash_attention": False,
    "cpu_int8_activations": False,
}


def has_executor_flag() -> bool:
    from ember.config import EngineConfig

    return "executor" in {f.name for f in dataclasses.fields(EngineConfig)}


def configs(base: dict) -> list[tuple[str, dict]]:
    """(row name, engine knobs), each row the one before plus one lever."""
    # compilation_config is only valid with the compiled executor: off until its row
    off = dict(OFF, executor="eager", compilation_config=None) if has_executor_flag() else dict(OFF)
    levers = [
        ("+ int8 weight-only decode copy", {"int8_decode": True}),
        ("+ packed GGUF weights", {"quantization": "auto", "int8_decode": None}),
        ("+ dense copy of packed weights for batches", {"int4_dense_copy": None}),
        ("+ tiled AVX-512 GEMV for packed weights", {"cpu_tiled_gemv": True}),
        ("+ int8 activations for many-row steps (no dense copy)", {"cpu_int8_activations": True}),
        ("+ fused C++ decode attention", {"cpu_paged_attention": True}),
        ("+ fused C++ RMSNorm and SiLU*up", {"cpu_fused_elementwise": True}),
        ("+ flash C++ prefill attention", {"cpu_flash_attention": True}),
        ("+ chunked prefill", {"enable_chunked_prefill": True}),
        ("+ MTP speculation", {"enable_mtp": True}),
    ]
    if has_executor_flag():
        levers.append(
            (
                "+ compiled executor",
                {"executor": "compiled", "enforce_eager": False, "compilation_config": base.get("compilation_config")},
            )
        )
    rows, knobs = [("everything off", {**base, **off})], {**base, **off}
    for name, change in levers:
        knobs = {**knobs, **change}
        rows.append((name, knobs))
    return rows


LEVERS = (
    "quantization",
    "int8_decode",
    "int4_dense_copy",
    "cpu_tiled_gemv",
    "cpu_int8_activations",
    "cpu_paged_attention",
    "cpu_fused_elementwise",
    "cpu_flash_attention",
    "enable_chunked_prefill",
    "enable_mtp",
    "enforce_eager",
    "executor",
)


def lever_values(knobs: dict) -> str:
    return ", ".join(f"{k}={knobs[k]}" for k in LEVERS if k in knobs)


def table(figures: list[dict], rows: list[dict], rss: dict) -> list[str]:
    columns = ["config"] + [f"{f['name']} ({f['unit']})" for f in figures] + ["peak RSS (MiB)"]
    lines = [row(columns), "|---|" + "---:|" * (len(columns) - 1)]
    for r in rows:
        name = r["name"]
        lines.append(
            row([f"{name} ({r['knobs']})"] + [cell(f["values"].get(name)) for f in figures] + [fmt(rss.get(name))])
        )
    return lines


def notes(args, shared: bool) -> list[str]:
    """How each figure was measured, for the report."""
    return [
        f"{args.runs} measured rounds after 1 warmup round (which also pays any compilation); cells are "
        "median [min-max]; every row sees the same seeded random prompts, new each round",
        f"decode: greedy, {args.decode_tokens} tokens, EOS ignored, mean rate; TTFT: add_request() to the "
        "first token; throughput: one LLM.generate() over all prompts, EOS ignored",
        "rows are cumulative: each is the row above plus one lever"
        + ("" if has_executor_flag() else "; no compiled-executor row: this build has no --executor flag"),
        "peak RSS: the whole process's high-water mark (--in-process), not attributable"
        if shared
        else "peak RSS: each row's own worker process (getrusage high-water mark, incl. the interpreter, "
        "libraries and the preallocated KV pool)",
    ]


def main(args) -> None:
    from ember.errors import ConfigError

    if args.decode_tokens < 2:
        raise ConfigError(f"--decode-tokens must be >= 2 (got {args.decode_tokens})")
    base, threads = ember_knobs(args, args.num_prompts)
    rows = configs(base)
    if args.configs:
        names = [n for n, _ in rows]
        bad = [c for c in args.configs if c not in names]
        if bad:
            raise ConfigError(f"--configs: no row named {bad}; rows are: {names}")
        rows = [(n, k) for n, k in rows if n in args.configs]
    lo, hi = args.input_len_range
    sides = {}
    try:
        for name, knobs in rows:
            sides[name] = start_side(EMBER, knobs, threads, args.in_process)
        maker = prompt_maker_of(next(iter(sides.values())), args.prompt_seed)
        tasks = [
            ttft_task(maker, args.prompt_len),
            decode_task(maker, args.decode_tokens),
            throughput_task(maker, args.num_prompts, lo, hi, args.output_len),
        ]
        load = load_average()
        results, _ = measure(sides, tasks, runs=args.runs, quiet_wait_s=args.quiet_wait, desc="bench matrix")
        rss = {n: s.peak_rss_bytes() / (1 << 20) for n, s in sides.items()}
        shared = any(s.shared_process for s in sides.values())
        descriptions = {n: s.description for n, s in sides.items()}
    finally:
        for s in sides.values():
            s.close()
    figures = [
        f for f in summarize_figures([f for t in tasks for f in t.figures], results) if f["key"] != "decode_steady"
    ]
    command = command_line(
        args,
        [
            "runs",
            "output",
            "prompt_seed",
            "quiet_wait",
            "prompt_len",
            "decode_tokens",
            "num_prompts",
            "input_len_range",
            "output_len",
        ],
    )
    command += switches(args) + (f" --configs {','.join(args.configs)}" if args.configs else "")
    rows = [{"name": n, "knobs": lever_values(kn), "engine": descriptions[n]} for n, kn in rows]
    data = {
        "threads": threads,
        "runs": args.runs,
        "figures": figures,
        "peak_rss_mib": rss,
        "rss_shared_process": shared,
        "rows": rows,
        "executor_flag": has_executor_flag(),
    }
    Result(KIND, TITLE, command, load, [], notes(args, shared), table(figures, rows, rss), data).publish(args.output)


def add_cli_args(p) -> None:
    # ember alone: --peer only accepts none here, and is not listed
    add_common_args(p, {"choices": ("none",), "default": "none", "help": argparse.SUPPRESS})
    p.add_argument(
        "--prompt-len",
        type=positive_int,
        default=2000,
        help="TTFT prompt length: the longest this machine handles in reasonable time",
    )
    p.add_argument(
        "--configs",
        type=names,
        default=None,
        metavar="NAME,NAME,...",
        help="only these rows (by name, e.g. 'everything off,+ packed GGUF weights')",
    )
    add_workload_args(p, prompt_help="for quick checks")
