"""`ember bench restart`: batch-1 decode in the first minute after `ember serve` restarts, against
ember's own steady compiled speed and llama.cpp's on the same file, measured in the same run.

What a user of `make run` gets after a restart, when they start talking at once. Each round:
- ember: launch `ember serve [flags]` as a user would, on this machine's compile cache as it is
  (run it after `ember compile` or a first server: a restart), wait for /health, then stream greedy
  answers of --decode-tokens tokens (EOS ignored) one after another until --window seconds have
  passed since /health. "first minute" = the tokens after each answer's first, summed, over the time
  from each answer's first token to its last, summed (prefill time is not decode time). Then wait
  for the background compile to finish (/metrics ember:executor_compiling 0) and stream --answers
  more: "steady" = their median. SIGTERM.
- llama.cpp: llama-cpp-python in a worker process of its own (the bench extra), same GGUF file,
  same threads, flash attention, the same prompt token ids: --answers answers, their median.
Every answer decodes after the same held-out chat request (lib/prompts.py's held_out_prompts, new
each round), sent to ember as token ids through /v1/completions, so both engines see the same
tokens. Rounds alternate which side goes first. Ratios are taken round by round.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import tempfile
import time

from ember.bench.lib.args import add_benchmark_group, command_line
from ember.bench.lib.bar import Bar
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import cell
from ember.bench.lib.prompts import chat_prompts
from ember.bench.lib.result import Result
from ember.bench.lib.rounds import spread
from ember.bench.lib.servers import compiling, ember_start, free_port, launch_plan, stream
from ember.bench.lib.timing import decode_rates
from ember.errors import ConfigError

logger = logging.getLogger("ember.bench")

NAME = KIND = "restart"
HELP = (
    "batch-1 decode in the first minute after ember serve restarts, against its steady compiled speed and "
    "llama.cpp's on the same file"
)


def stream_times(url: str, model: str, prompt: list[int], n: int) -> list[float]:
    """time.monotonic() arrival time of each generated token of one streamed greedy completion (tokens that
    arrive in one chunk, as a speculative step brings them, share its time)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    times: list[float] = []
    for chunk in stream(url + "/v1/completions", body):
        choices = chunk.get("choices") or []
        ids = choices[0].get("token_ids") if choices else None
        if ids:
            now = time.monotonic()
            times += [now] * len(ids)
    if len(times) < 2:
        raise ConfigError(f"the server streamed {len(times)} tokens for a {n}-token request")
    return times


def _metric(url: str, name: str) -> float | None:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def ember_round(flags: list[str], prompt: list[int], args) -> dict:
    import httpx

    cold = tempfile.mkdtemp(prefix="ember-bench-cold-") if args.cold else None
    start = ember_start(flags, cold, free_port())
    try:
        health = start.health(args.timeout)
        model = httpx.get(start.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        shapes_at_health = _metric(start.url, "ember:executor_compiled_shapes")
        # launch -> nothing left to compile: at /health, or read after each answer (an upper bound)
        compiled = None if compiling(httpx.get(start.url + "/metrics", timeout=5).text) else health
        window_end = time.monotonic() + args.window
        tokens = seconds = 0.0
        # (seconds from launch to the answer's first token, its tok/s, graphs in use after it, to its last token)
        answers: list[tuple] = []
        first_token = None
        while time.monotonic() < window_end:
            times = stream_times(start.url, model, prompt, args.decode_tokens)
            if first_token is None:
                first_token = times[0] - start.t0
            tokens += len(times) - 1
            seconds += times[-1] - times[0]
            answers.append(
                (
                    round(times[0] - start.t0, 1),
                    round((len(times) - 1) / (times[-1] - times[0]), 1),
                    _metric(start.url, "ember:executor_compiled_shapes"),
                    round(times[-1] - start.t0, 1),
                )
            )
            if compiled is None and not compiling(httpx.get(start.url + "/metrics", timeout=5).text):
                compiled = times[-1] - start.t0
        first_minute = tokens / seconds
        shapes_after_window = _metric(start.url, "ember:executor_compiled_shapes")
        if compiled is None:
            compiled = start.compiled(args.timeout)
        steady = [
            decode_rates(stream_times(start.url, model, prompt, args.decode_tokens))[0] for _ in range(args.answers)
        ]
        start.log.flush()
        start.log.seek(0)
        compile_log = [
            line.strip()
            for line in start.log.read().splitlines()
            if "compiled in" in line or "warmup:" in line or "decode steps:" in line
        ]
        # at /health when graphs were loaded before serving; else an upper bound (read after each answer)
        in_use = round(health, 1) if shapes_at_health else next((a[3] for a in answers if a[2]), None)
        return {
            "compile_log": compile_log,
            "graphs_in_use_by_s": in_use,
            "health_s": round(health, 2),
            "first_token_s": round(first_token, 2),
            "compiled_s": None if compiled is None else round(compiled, 1),
            "shapes_at_health": shapes_at_health,
            "shapes_after_window": shapes_after_window,
            "first_minute_answers": answers,
            "first_minute_tok_s": first_minute,
            "steady_tok_s": statistics.median(steady),
            "steady_runs": steady,
        }
    finally:
        start.stop()
        if cold is not None:
            shutil.rmtree(cold, ignore_errors=True)


def main(args) -> None:
    from ember.bench.peers import PEERS
    from ember.bench.sides.worker import RemoteSide

    model, flags, threads = launch_plan(args)
    prompts = chat_prompts(model)
    peer = None
    if args.peer == "llamacpp":
        peer = RemoteSide(PEERS["llamacpp"], {"gguf_path": model, "threads": threads, "n_ctx": 4096}, threads)
    load = load_average()
    rounds = []
    try:
        for r in range(args.runs):
            prompt = prompts(r)
            row: dict = {"round": r, "prompt_tokens": len(prompt)}
            order = ["ember", "llamacpp"] if r % 2 == 0 else ["llamacpp", "ember"]
            for side in order:
                if side == "ember":
                    row["ember"] = ember_round(flags, prompt, args)
                elif peer is not None:
                    runs = [decode_rates(peer.decode(prompt, args.decode_tokens))[0] for _ in range(args.answers)]
                    row["llamacpp"] = {"tok_s": statistics.median(runs), "runs": runs}
            logger.info("bench restart: round %d: %s", r, row)
            rounds.append(row)
    finally:
        if peer is not None:
            peer.close()
    command = command_line(args, ["runs", "peer", "window", "decode_tokens", "answers", "output"])
    summary = summarize(rounds)
    title = (
        "First start: a model never compiled on this machine, under continuous batch-1 load"
        if args.cold
        else "Restart: batch-1 decode in the first minute after `ember serve` restarts"
    )
    about = [
        f"model: `{model}`; {threads} threads; ember flags: `{' '.join(flags) or '(defaults, as make run serves)'}`; "
        f"{len(rounds)} rounds, median [min-max], ratios round by round",
        (
            "ember starts on an empty compile cache of its own (TORCHINDUCTOR_CACHE_DIR in a fresh folder); "
            if args.cold
            else "ember restarts on this machine's compile cache as it is (a restart, not a first start); "
        )
        + "first minute: greedy answers streamed back to back from /health for the window, decode tokens over "
        "decode time; steady: after the background compile finished; llama.cpp: llama-cpp-python in its own "
        "process on the same file and prompt token ids (ember.bench.commands.restart)",
    ]
    data = {"cold": args.cold, "threads": threads, "model": model, "flags": flags, "rounds": rounds, "summary": summary}
    Result(
        "first-start" if args.cold else KIND,
        title,
        command + (" --cold" if args.cold else ""),
        load,
        about,
        [],
        table(summary),
        data,
        bars(summary, args.cold),
        "ratio",
    ).publish(args.output)


def summarize(rounds: list[dict]) -> dict:
    e = [r["ember"] for r in rounds]
    out = {
        key: spread([x[key] for x in e if x.get(key) is not None])
        for key in (
            "health_s",
            "first_token_s",
            "graphs_in_use_by_s",
            "compiled_s",
            "first_minute_tok_s",
            "steady_tok_s",
        )
    }
    out["first_minute_over_steady"] = spread([x["first_minute_tok_s"] / x["steady_tok_s"] for x in e])
    peer = [r for r in rounds if "llamacpp" in r]
    if peer:
        out["llamacpp_tok_s"] = spread([r["llamacpp"]["tok_s"] for r in peer])
        out["first_minute_over_llamacpp"] = spread(
            [r["ember"]["first_minute_tok_s"] / r["llamacpp"]["tok_s"] for r in peer]
        )
        out["steady_over_llamacpp"] = spread([r["ember"]["steady_tok_s"] / r["llamacpp"]["tok_s"] for r in peer])
    return out


def _cell(s: dict | None, number: str = "{:.1f}") -> str:
    return cell(s, number=number.format)


def table(s: dict) -> list[str]:
    lines = [
        "| figure | value |",
        "|---|---:|",
        f"| ember: launch to /health 200 (s) | {_cell(s.get('health_s'), '{:.2f}')} |",
        f"| ember: launch to the first token (s) | {_cell(s.get('first_token_s'), '{:.2f}')} |",
        f"| ember: launch to its first graphs in use, under that load (s; read after each answer) | "
        f"{_cell(s.get('graphs_in_use_by_s'))} |",
        f"| ember: launch to every graph built (s; larger batch sizes wait for a pause) | {_cell(s.get('compiled_s'))} |",
        f"| ember decode over the window (tok/s) | {_cell(s.get('first_minute_tok_s'))} |",
        f"| ember steady compiled decode (tok/s) | {_cell(s.get('steady_tok_s'))} |",
    ]
    if "llamacpp_tok_s" in s:
        lines += [
            f"| llama.cpp decode (tok/s) | {_cell(s['llamacpp_tok_s'])} |",
            f"| ember steady / llama.cpp decode (ratio) | {_cell(s['steady_over_llamacpp'], '{:.2f}')} |",
        ]
    return lines


def bars(s: dict, cold: bool) -> list[Bar]:
    if cold:
        used = s.get("graphs_in_use_by_s")  # none in use within the window: failed
        return [
            Bar(
                "first graphs in use within 180 s of launch",
                "<=",
                180,
                used["max"] if used else None,
                shown=f"{_cell(used)} s",
                unmet=not used,
            )
        ]
    fm = s["first_minute_over_steady"]
    out = [Bar("first minute >= 0.95x ember's steady", ">=", 0.95, fm["median"], (fm["min"], fm["max"]))]
    if "first_minute_over_llamacpp" in s:
        fl = s["first_minute_over_llamacpp"]
        out.append(Bar("first minute >= 1.3x llama.cpp", ">=", 1.3, fl["median"], (fl["min"], fl["max"])))
    return out


def add_cli_args(p) -> None:
    g = add_benchmark_group(p)
    g.add_argument("--runs", type=int, default=3, help="rounds (each restarts the server)")
    g.add_argument("--peer", choices=["llamacpp", "none"], default="llamacpp")
    g.add_argument("--window", type=float, default=60.0, help="seconds from /health that count as the first minute")
    g.add_argument("--decode-tokens", type=int, default=256, help="tokens per answer")
    g.add_argument("--answers", type=int, default=3, help="answers per side for the steady figures")
    g.add_argument("--timeout", type=float, default=900.0, help="seconds a start (and its compile) may take")
    g.add_argument(
        "--cold",
        action="store_true",
        help="a first start instead: each round on an empty compile cache of its own (give a longer "
        "--window to see when the graphs arrive under continuous load)",
    )
    g.add_argument("--output", default="benchmarks/startup.md", help="markdown file; the JSON goes beside it")
