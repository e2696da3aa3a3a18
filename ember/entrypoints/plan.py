"""`ember plan [MODEL] [engine flags]`: the memory arithmetic of ember.engine.planner as a table (or --json), for
the engine that `ember serve` with the same flags would start."""

from __future__ import annotations

import argparse
import json


def add_plan_parser(sub) -> None:
    from ember.config.engine_args import add_engine_args

    p = sub.add_parser(
        "plan",
        help="memory plan: weights, KV bytes per token, the longest context and concurrency that fit",
        description="Plan memory for a model without loading it, for the engine these flags would start "
        "(ember serve's own flags). MODEL: a config.json, a Hugging Face folder (config.json "
        "alone is enough), a .gguf file, or nothing for the default model. --device auto "
        "(the default) plans for CUDA; --device cpu against this machine's RAM.",
    )
    p.add_argument(
        "--memory",
        type=float,
        default=None,
        help="GiB of device memory (default: the CUDA device's, or available RAM with --device cpu)",
    )
    p.add_argument(
        "--host-memory",
        type=float,
        default=None,
        help="GiB of host memory beside a card, which holds the experts --cpu-moe / --n-cpu-moe keep there "
        "(default: this machine's available RAM)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    add_engine_args(p)
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> None:
    from ember.config.engine_args import engine_config_from_args
    from ember.engine.planner import format_plan, plan

    result = plan(engine_config_from_args(args), memory_gib=args.memory, host_memory_gib=args.host_memory)
    print(json.dumps(result.to_dict(), indent=2) if args.json else format_plan(result))
