"""SGLang's launch line, for ember: `python -m ember.launch_server --model-path M --context-length N ...`.

The same server and flags as `ember serve` (SGLang's flag names are accepted with a note, see
ember.config.aliases), listening on SGLang's default port 30000 unless --port says otherwise.
"""

from __future__ import annotations

import argparse
import sys

SGLANG_PORT = 30000


def build_parser() -> argparse.ArgumentParser:
    from ember.server.launcher import add_server_args

    parser = argparse.ArgumentParser(
        prog="python -m ember.launch_server",
        description="ember's OpenAI-compatible server, launched as SGLang's is (same flags "
        "as `ember serve`; SGLang's names for them are accepted)",
    )
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_server_args(parser)
    parser.set_defaults(port=SGLANG_PORT)
    return parser


def main(argv: list[str] | None = None) -> int:
    from ember.entrypoints.cli import run_command
    from ember.entrypoints.serve import run_server

    return run_command(run_server, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
