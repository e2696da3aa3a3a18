"""`ember bench <command>`: measure ember and its peers side by side, write the results files.

COMMANDS is the single list of benchmarks, in the order `ember bench --help` lists them (mini-sglang's
registry idea: a plain list of modules). Each is a module of bench/commands/ with NAME, HELP,
add_cli_args(parser) and main(args), the shape of vLLM's benchmarks/latency.py, and PARSER (more
add_parser keywords) where its --help has a description. Adding a benchmark is a module and a line here.
"""

from __future__ import annotations

from ember.bench.commands import (
    compare,
    flash,
    gdn_prefill,
    hybrid,
    latency,
    matrix,
    quant,
    readme_table,
    restart,
    serve,
    spec,
    startup,
    structured,
    throughput,
    tp,
)

COMMANDS = [
    latency,
    throughput,
    serve,
    quant,
    spec,
    tp,
    compare,
    hybrid,
    flash,
    gdn_prefill,
    matrix,
    readme_table,
    restart,
    startup,
    structured,
]


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark ember against transformers and write a results file")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="{" + ",".join(c.NAME for c in COMMANDS) + "}")
    for command in COMMANDS:
        cp = sub.add_parser(command.NAME, help=command.HELP, **getattr(command, "PARSER", {}))
        command.add_cli_args(cp)
        cp.set_defaults(func=command.main)
