"""Claude Code's billing-header line against ember's prefix cache: the second turn of a conversation over
/v1/messages, with the line dropped (what ember does) and kept.

    python benchmarks/anthropic_billing_header.py [--rounds 3] [--out benchmarks/anthropic-billing-header.md]

Claude Code puts `x-anthropic-billing-header: cc_version=...; cch=<hash>;` as the first system block of every
request, with a new cch= each time. ember drops that line (ember.server.anthropic.translate), so turn 2's
prompt starts with turn 1's and the prefix cache serves it. "kept" sends the same changing line under a name
ember does not drop (`x-billing-header:`), which is what the line would cost if it reached the prompt: every
token after it is new.

`ember serve` with its defaults (the default model, prefix caching on) is started once and waited for until
its background compile is done. Each round and mode runs a fresh conversation of ~1,500 prompt tokens (a
session line makes it new): turn 1 streams a 32-token answer, then turn 2 (turn 1, that answer and a new
question, and a new cch= value) is timed: TTFT is the time from sending it to its first
content_block_delta, and cache_read_input_tokens is read from its message_start. Medians over the rounds.
"""

from __future__ import annotations

import argparse
import json
import pydoc_data.topics
import statistics
import time
import uuid
from pathlib import Path

import httpx

from ember.bench.lib.machine import load_average, machine_info, machine_line
from ember.bench.lib.servers import ember_start, free_port

DROPPED = "x-anthropic-billing-header:"  # the line Claude Code sends, which ember drops
KEPT = "x-billing-header:"  # the same line under a name ember keeps
MODEL = "claude-sonnet-4-5"
# Claude Code's system prompt stands in as Python's own documentation: English text on this machine
TOPICS = ("with", "while", "assert", "lambda")  # ~1,370 tokens of the default model


def system_text() -> str:
    return "You are a coding assistant. Use this reference when you answer.\n\n" + "\n".join(
        pydoc_data.topics.topics[t] for t in TOPICS
    )


def billing_line(name: str) -> str:
    return f"{name} cc_version=2.1.37.3a3; cc_entrypoint=cli; cch={uuid.uuid4().hex[:5]};"


def send(url: str, body: dict) -> dict:
    """Stream one Messages request: its TTFT (s), message_start's usage and the answer's text."""
    t0 = time.perf_counter()
    ttft, usage, text = None, None, []
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            if event["type"] == "message_start":
                usage = event["message"]["usage"]
            elif event["type"] == "content_block_delta":
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                text.append(event["delta"].get("text", ""))
    return {"ttft": ttft, "usage": usage, "text": "".join(text)}


def second_turn(url: str, header: str, system: str) -> dict:
    """A fresh conversation's turn 1, then its timed turn 2 with a new cch= value."""
    session = [{"type": "text", "text": f"Session {uuid.uuid4().hex}.\n{system}"}]
    ask = [{"role": "user", "content": "Explain the difference between `with` and `try`/`finally` in Python."}]
    first = {"model": MODEL, "max_tokens": 32, "temperature": 0, "messages": ask}
    answer = send(url, {**first, "system": [{"type": "text", "text": billing_line(header)}, *session]})["text"]
    follow = [*ask, {"role": "assistant", "content": answer}, {"role": "user", "content": "Show a short example."}]
    body = {
        **first,
        "max_tokens": 8,
        "messages": follow,
        "system": [{"type": "text", "text": billing_line(header)}, *session],
    }
    return send(url, body)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="benchmarks/anthropic-billing-header.md")
    args = p.parse_args()

    server = ember_start([], None, free_port())
    try:
        server.health(timeout=1800, steady=True)
        system = system_text()
        send(server.url, {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})  # warm
        load_at_start = load_average()
        runs: dict[str, list[dict]] = {"dropped": [], "kept": []}
        for r in range(args.rounds):
            for mode, header in (("dropped", DROPPED), ("kept", KEPT)):
                got = second_turn(server.url, header, system)
                runs[mode].append(got)
                u = got["usage"]
                print(
                    f"round {r + 1} {mode:7s}: TTFT {got['ttft'] * 1000:7.1f} ms, prompt "
                    f"{u['input_tokens'] + u['cache_read_input_tokens']} tokens, cache read {u['cache_read_input_tokens']}",
                    flush=True,
                )
        command = server.command
    finally:
        server.stop()
    write_table(Path(args.out), runs, command, args.rounds, (load_at_start, load_average()))


def write_table(out: Path, runs: dict[str, list[dict]], command: str, rounds: int, loads: tuple) -> None:
    rows = []
    for mode, label in (("dropped", "dropped (ember)"), ("kept", "kept (the same line, not dropped)")):
        got = runs[mode]
        ttfts = [g["ttft"] * 1000 for g in got]
        reads = [g["usage"]["cache_read_input_tokens"] for g in got]
        prompt = [g["usage"]["input_tokens"] + g["usage"]["cache_read_input_tokens"] for g in got]
        rows.append(
            f"| {label} | {statistics.median(prompt):.0f} | {statistics.median(reads):.0f} | "
            f"{statistics.median(ttfts):.0f} | {', '.join(f'{t:.0f}' for t in ttfts)} |"
        )
    kept, dropped = (statistics.median(g["ttft"] * 1000 for g in runs[m]) for m in ("kept", "dropped"))
    machine = machine_info()
    busy = max(x or 0.0 for x in loads) > machine["usable_cores"]
    shared = " (above the core count: other processes shared the cores, so the TTFTs are longer)" if busy else ""
    text = f"""# Claude Code's billing-header line and the prefix cache

Turn 2 of a ~1,500-token conversation over `/v1/messages`, its `cch=` value changed from turn 1, as Claude Code
sends it. Medians of {rounds} rounds (each round a fresh conversation per mode).

- machine: {machine_line(machine)}
- server: `{command}` (defaults: the default model, prefix caching on; measured after its background compile)
- command: `python benchmarks/anthropic_billing_header.py --rounds {rounds}`
- 1-minute load average when the rounds began and ended: {loads[0]} / {loads[1]}{shared}

| billing line | turn-2 prompt tokens | cache_read_input_tokens | TTFT ms (median) | TTFT ms (each round) |
|---|---|---|---|---|
{chr(10).join(rows)}

Dropping the line cuts turn 2's median TTFT from {kept:.0f} ms to {dropped:.0f} ms ({kept / dropped:.1f}x): its prompt
begins as turn 1's did, so the prefix cache serves all of turn 1 and only the new tokens are computed. Kept,
the changing line is the prompt's first tokens and nothing after it can be a cache hit.
"""
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
