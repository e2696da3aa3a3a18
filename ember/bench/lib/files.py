"""Results files: one markdown file holds one section per benchmark kind, fenced by HTML comments, so each
command (`ember bench latency`, `ember bench throughput`, ...) rewrites only its own section; next to it
goes a JSON file per kind with every raw run, for tables generated later.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

logger = logging.getLogger("ember.bench")

HEADER = (
    "# ember CPU benchmarks\n\n"
    "Written by `ember bench ...`; each section is rewritten only by its own command. "
    "Raw runs are in the JSON files next to this one.\n"
)


def update_markdown(text: str, kind: str, section: str) -> str:
    """`text` with the section of `kind` replaced (or appended when it is not there yet)."""
    begin, end = f"<!-- ember-bench:{kind}:begin -->", f"<!-- ember-bench:{kind}:end -->"
    block = f"{begin}\n{section}{end}\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    return text.rstrip("\n") + "\n\n" + block


def json_path(md_path: str | os.PathLike, kind: str) -> Path:
    p = Path(md_path)
    return p.with_name(f"{p.stem}-{kind}.json")


def publish(
    md_path: str | os.PathLike,
    kind: str,
    section: str,
    data: dict,
    *,
    header: str = HEADER,
    json_file: Path | None = None,
) -> None:
    """Rewrite the section of `kind` in the markdown file (a new file starts with `header`), write `data`
    to its JSON file (default <stem>-<kind>.json beside it), print the section and log both paths."""
    md = Path(md_path)
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(update_markdown(md.read_text() if md.exists() else header, kind, section))
    js = json_file or json_path(md, kind)
    js.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(section)
    logger.info("bench %s: wrote %s and %s", kind, md, js)
