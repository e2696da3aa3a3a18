"""vLLM's launch line, for ember: `python -m ember.entrypoints.openai.api_server --model M [flags]`.

The same server and flags as `ember serve` (the model may also be given positionally).
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from ember.server.launcher import add_server_args

    parser = argparse.ArgumentParser(
        prog="python -m ember.entrypoints.openai.api_server",
        description="ember's OpenAI-compatible server (same flags as `ember serve`)",
    )
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_server_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ember.entrypoints.cli import run_command
    from ember.entrypoints.serve import run_server

    return run_command(run_server, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
