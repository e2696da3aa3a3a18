"""vLLM's launch line, for ember: `python -m ember.entrypoints.openai.api_server --model M [flags]`.

The same server and flags as `ember serve` (the model may also be given positionally).
"""
from __future__ import annotations

import argparse
import logging
import sys

from ember.errors import EmberError


def build_parser() -> argparse.ArgumentParser:
    from ember.server.launcher import add_server_args

    parser = argparse.ArgumentParser(prog="python -m ember.entrypoints.openai.api_server",
                                     description="ember's OpenAI-compatible server (same flags as `ember serve`)")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_server_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ember.server.launcher import run_server

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        run_server(args)
    except EmberError as e:
        print(f"ember: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
