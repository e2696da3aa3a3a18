"""The flags benchmark commands share, their value types, and the command line a run writes into its results.

Every engine flag works in the commands that build an engine (the same generated set as `ember serve`),
so a tuned configuration can be benchmarked exactly as it will be served.
"""

from __future__ import annotations

import argparse
import shlex

from ember.config.engine_args import add_engine_args, engine_args_to_words

DEFAULT_OUTPUT = "benchmarks/cpu.md"


def positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {v})")
    return v


def int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers like 128,512,2048 (got {s!r})") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"want one or more integers >= 1 (got {s!r})")
    return vals


def int_range(s: str) -> list[int]:
    try:
        lo, hi = (int(x) for x in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want LO,HI like 128,512 (got {s!r})") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want 1 <= LO <= HI (got {s!r})")
    return [lo, hi]


def names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def add_benchmark_group(p: argparse.ArgumentParser):
    """The engine flags (the same generated set as `ember serve`), then the "benchmark" group a command
    adds its own flags to."""
    add_engine_args(p)
    return p.add_argument_group("benchmark")


HF_PEER = {
    "choices": ("hf", "none"),
    "default": "hf",
    "help": "hf = Hugging Face transformers on the same weights (bf16), measured in the same run",
}


def add_common_args(p: argparse.ArgumentParser, peer: dict = HF_PEER) -> None:
    """The engine flags plus the benchmark group of the commands that measure ember against a peer; `peer`:
    add_argument's keywords for --peer (which peers the command has)."""
    g = add_benchmark_group(p)
    g.add_argument("--runs", type=positive_int, default=3, help="measured runs after one warmup; medians are reported")
    g.add_argument("--peer", **peer)
    g.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        help="markdown results file; this benchmark's section is rewritten and a JSON file "
        "<stem>-<kind>.json is written next to it",
    )
    g.add_argument(
        "--prompt-seed",
        type=int,
        default=0,
        help="seed of the random prompts (both sides get the same ones; change it for another sample)",
    )
    g.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="before each measured ember/peer pair, wait up to this long for other processes to leave "
        "the CPU idle (0 = don't wait); what they used during each measurement is reported either way",
    )


def add_workload_args(p: argparse.ArgumentParser, *, prompt_help: str) -> None:
    """The workload flags of the commands that measure sides in rounds (compare, hybrid, matrix)."""
    p.add_argument("--decode-tokens", type=int, default=256, help="greedy tokens for the batch-1 decode figure (>= 2)")
    p.add_argument("--num-prompts", type=positive_int, default=64, help="prompts of the offline throughput figure")
    p.add_argument(
        "--input-len-range",
        type=int_range,
        default=[128, 512],
        metavar="LO,HI",
        help="throughput prompt lengths, drawn uniformly (seeded)",
    )
    p.add_argument("--output-len", type=positive_int, default=128, help="tokens generated per throughput prompt")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="build every side in this process instead of one worker process each: starts faster, but "
        "peak RSS is then the whole process's, not each side's (" + prompt_help + ")",
    )


def command_line(args, bench_flags: list[str], engine: bool = True) -> str:
    """The full command that reproduces this run: every benchmark flag that has a value, with it, plus the
    engine flags that were given (engine flags default to SUPPRESS, so present = given). engine=False: the
    command has no engine flags (its own may share their names)."""
    words = ["ember", "bench", args.bench_command] + (engine_args_to_words(args) if engine else [])
    for name in bench_flags:
        v = getattr(args, name)
        if v is not None:
            words += ["--" + name.replace("_", "-"), ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return shlex.join(words)


def switches(args, **off_flags: str) -> str:
    """The on/off flags of a command line as typed: --in-process when set, plus each `name` whose
    value is False written as its off flag."""
    words = [" --in-process"] if args.in_process else []
    words += [f" {flag}" for name, flag in off_flags.items() if not getattr(args, name)]
    return "".join(words)
