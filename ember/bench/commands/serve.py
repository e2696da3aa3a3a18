"""`ember bench serve`: load an OpenAI-compatible server with streaming requests and write the results.

Two ways to point it at a server:

- `--url URL`: any OpenAI-compatible server (ember, vLLM, llama.cpp's server): only the HTTP API
  is used, so two engines are measured the same way.
- `--launch [MODEL] [engine flags]`: start `ember serve` on a free local port, run the sweep, and
  in the same run measure the offline engine (`LLM.generate` in this process, same flags, same
  number of prompts and lengths) so the server's overhead is a ratio measured side by side. The
  server is stopped at the end.

Prompts: token ids drawn from the tokenizer's ordinary tokens, sent to /v1/completions, when a
tokenizer is known (`--launch`, or `--tokenizer PATH` with `--url`); otherwise text of random
English words sized to the target length by fitting the server's own usage.prompt_tokens (chat
prompts include the chat template). Every level gets fresh prompts, so no prefix cache helps.

The client (this process) and the server share the machine: the report gives the CPU cores each
used during every level, so the load generator's own cost is visible.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import random
import shlex
import statistics
import time
from typing import Callable

from ember.bench.lib import load
from ember.bench.lib.args import int_list, positive_int
from ember.bench.lib.bar import Bar
from ember.bench.lib.cpu import CONTENDED_CORES, RETRIES, CpuMeter, wait_for_quiet
from ember.bench.lib.files import json_path
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import describe, fmt
from ember.bench.lib.prompts import load_tokenizer, ordinary_tokens
from ember.bench.lib.result import Result
from ember.bench.lib.servers import Server, free_port, serve_argv
from ember.bench.lib.timing import ember_batch
from ember.bench.sides.ember import describe_engine
from ember.config.engine_args import engine_args_to_words
from ember.errors import ConfigError

logger = logging.getLogger("ember.bench")

NAME = "serve"
HELP = (
    "streaming load against an OpenAI-compatible server (--url) or a launched `ember serve` (--launch): TTFT, "
    "TPOT, ITL, tok/s"
)
PARSER = {"description": __doc__, "formatter_class": argparse.RawDescriptionHelpFormatter}
DEFAULT_OUTPUT = "benchmarks/serve.md"
DEFAULT_LAUNCH_LEVELS = [1, 8, 32]
LEVEL_SEED = 1_000  # each (run, level) draws prompts of its own
WARMUP_SEED = 90_000
CALIBRATION_SEED = 77_777
MIN_SERVER_OVER_OFFLINE_THROUGHPUT = 0.8
TTFT_JUDGED_AT_CONCURRENCY = 8
MAX_TTFT_P50_MS = 1000.0

HEADER = (
    "# ember serving benchmarks\n\n"
    "Written by `ember bench serve`; each section (one per server label) is rewritten only by its own run. "
    "Raw numbers are in the JSON files next to this one.\n"
)

METHOD_NOTES = [
    "TTFT: request sent -> first SSE chunk carrying generated text (the empty role chunk of chat does not count)",
    "ITL: gaps between consecutive chunks carrying text, pooled over requests; TPOT: (e2e - TTFT) / (output tokens - 1) "
    "per request; e2e: request sent -> `data: [DONE]`",
    "tokens are counted from each stream's final `usage` (stream_options.include_usage); rates are tokens over the "
    "level's wall time, first request sent -> last answer",
    "percentiles by linear interpolation; with --runs > 1 every figure is the median over runs",
]


# -- the offline side -------------------------------------------------------------------------------


def offline_batch(llm, specs: list[load.RequestSpec]) -> tuple[float, int, int]:
    """One LLM.generate over the specs (token ids, ignore_eos); (seconds, prompt tokens, output tokens)."""
    seconds, generated = ember_batch(llm, [s.prompt for s in specs], [s.output_len for s in specs])
    return seconds, sum(len(s.prompt) for s in specs), generated


# -- the workload ---------------------------------------------------------------------------------


class Workload:
    """Prompts for every (run, level): token ids from a tokenizer's ordinary tokens, or calibrated text."""

    def __init__(self, args, target: load.Target, pool: list[int] | None, use_ids: bool):
        self.args, self.target, self.pool, self.use_ids = args, target, pool, use_ids
        self.calibration: load.TextCalibration | None = None

    @property
    def kind(self) -> str:
        return "ids" if self.use_ids else "text"

    def calibrate(self) -> None:
        if not self.use_ids:
            self.calibration = asyncio.run(load.calibrate_text(self.target, self.args.input_len, CALIBRATION_SEED))
            logger.info(
                "bench serve: text prompts: %.2f prompt tokens per word + %.1f fixed",
                self.calibration.per_word,
                self.calibration.base,
            )

    def specs(
        self, seed: int, n: int | None = None, output_len: int | None = None, ids: bool = False, salt: int = 0
    ) -> list[load.RequestSpec]:
        """Requests of lengths drawn with `seed`; each `salt` draws other prompts of those same lengths (a redone
        measurement and the offline side get prompts of their own). ids=True: token ids even when the server
        gets text (the offline engine takes ids)."""
        a = self.args
        n = n or a.num_prompts
        rng = random.Random(a.prompt_seed * 1_000_003 + seed)
        ins = load.lengths(n, a.input_len, a.random_range_ratio, rng)
        outs = [output_len] * n if output_len else load.lengths(n, a.output_len, a.random_range_ratio, rng)
        s = a.prompt_seed * 1_000_003 + seed + 1 + 7919 * salt
        if ids or self.use_ids:
            return load.token_id_specs(self.pool, ins, outs, s)
        return load.text_specs(self.calibration.words_for, ins, outs, s)

    def describe(self, tokenizer_name: str | None) -> str:
        a = self.args
        lens = (
            f"{a.input_len} in / {a.output_len} out"
            if a.random_range_ratio <= 0
            else f"in ~U[{a.input_len * (1 - a.random_range_ratio):.0f}, {a.input_len * (1 + a.random_range_ratio):.0f}], "
            f"out ~U[{a.output_len * (1 - a.random_range_ratio):.0f}, {a.output_len * (1 + a.random_range_ratio):.0f}]"
        )
        eos = (
            "`ignore_eos: true` and `min_tokens` = max_tokens, so every request generates exactly max_tokens"
            if a.ignore_eos
            else "no ignore_eos: requests may stop early at EOS"
        )
        if self.kind == "ids":
            what = (
                f"seeded random prompts of token ids drawn from the ordinary (non-special) tokens of {tokenizer_name}, "
                f"sent as `prompt` to {self.target.path}"
            )
        else:
            c = self.calibration
            what = (
                f"text prompts of random English words (from pydoc_data.topics) sent to {self.target.path}, "
                f"sized with this server's usage.prompt_tokens ({c.per_word:.2f} tokens per word + {c.base:.1f} "
                "fixed, fitted on probe prompts); the measured prompt tokens are in the table"
            )
        return f"{a.num_prompts} requests per level, {lens}, greedy, new prompts every level; {what}; {eos}"


# -- one measurement ----------------------------------------------------------------------------------


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", dynamic_ncols=True, leave=False)


def measure_level(
    target: load.Target,
    specs: list[load.RequestSpec],
    concurrency: int | None,
    rate: float,
    seed: int,
    server_pid: int | None,
    desc: str,
) -> dict:
    """One load level through the server: {"stats": LevelStats as a dict, "cpu": cores each process used}."""
    bar = _progress(len(specs), desc)
    with CpuMeter(server_pid=server_pid) as cpu:
        results, seconds = load.run(
            target, specs, max_concurrency=concurrency, request_rate=rate, seed=seed, progress=lambda r: bar.update(1)
        )
    bar.close()
    stats = load.summarize(specs, results, seconds, max_concurrency=concurrency, request_rate=rate)
    logger.info(
        "bench serve %s: %d ok, %d failed in %.1fs; %.1f out tok/s; TTFT p50 %s ms; TPOT p50 %s ms "
        "(CPU cores: client %s, server %s, others %s)",
        desc,
        stats.completed,
        stats.failed,
        seconds,
        stats.output_throughput,
        fmt(stats.ttft_ms["p50"]),
        fmt(stats.tpot_ms["p50"]),
        cpu.own,
        cpu.server,
        cpu.others,
    )
    for e in stats.errors:
        logger.warning("bench serve %s: failed request: %s", desc, e)
    return {"stats": stats.to_dict(), "cpu": cpu.to_dict()}


def measure_offline(llm, specs: list[load.RequestSpec], server_pid: int | None, desc: str) -> dict:
    with CpuMeter(server_pid=server_pid) as cpu:
        seconds, prompt, out = offline_batch(llm, specs)
    d = {
        "seconds": seconds,
        "prompt_tokens": prompt,
        "output_tokens": out,
        "output_throughput": out / seconds,
        "total_throughput": (prompt + out) / seconds,
        "request_throughput": len(specs) / seconds,
        "cpu": cpu.to_dict(),
    }
    logger.info(
        "bench serve %s: %d prompts in %.1fs, %.1f out tok/s (CPU cores: this process %s, idle server %s, others %s)",
        desc,
        len(specs),
        seconds,
        d["output_throughput"],
        cpu.own,
        cpu.server,
        cpu.others,
    )
    return d


def redone_if_contended(measure_once: Callable[[int], dict], pid: int | None, quiet_wait: float, what: str) -> dict:
    """measure_once(attempt) after waiting for a quiet machine; redone (it draws fresh prompts per attempt) while
    other processes took over CONTENDED_CORES, up to RETRIES times. Its dict, with the attempts it took."""
    for attempt in range(RETRIES + 1):
        if quiet_wait > 0:
            wait_for_quiet(quiet_wait)
        run = measure_once(attempt)
        others = run["cpu"].get("others")
        # without the server's pid, "others" includes the server itself: nothing to judge
        if pid is None or others is None or others <= CONTENDED_CORES or attempt == RETRIES:
            return {**run, "attempts": attempt + 1}
        logger.info("bench serve: other processes used %.2f cores during %s; measuring it again", others, what)


# -- the sweep -----------------------------------------------------------------------------------------------


def _med(values: list) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _median_cpu(runs: list[dict]) -> dict:
    return {k: _med([r["cpu"][k] for r in runs]) for k in ("client", "server", "others")}


def median_level(runs: list[dict]) -> dict:
    """The median over runs of every figure of one level (each run: {"stats": LevelStats dict, "cpu": {...}})."""
    s = [r["stats"] for r in runs]
    out = {
        k: _med([x[k] for x in s])
        for k in (
            "completed",
            "failed",
            "seconds",
            "prompt_tokens",
            "output_tokens",
            "request_throughput",
            "output_throughput",
            "total_throughput",
        )
    }
    for dist in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_s"):
        out[dist] = {q: _med([x[dist][q] for x in s]) for q in s[0][dist]}
    out["cpu"] = _median_cpu(runs)
    out["expected_output_tokens"] = s[0]["expected_output_tokens"]
    out["usage_reported"] = all(x["usage_reported"] for x in s)
    out["errors"] = sorted({e for x in s for e in x["errors"]})[:5]
    return out


def _warmup(args, top: int | None, target: load.Target, work: Workload, pid: int | None, llm) -> int:
    """The top level's batch shape with short outputs, through the server and offline alike; how many prompts."""
    n_warm = args.warmup_prompts if args.warmup_prompts is not None else min(args.num_prompts, top or args.num_prompts)
    if n_warm:
        specs = work.specs(WARMUP_SEED, n=n_warm, output_len=min(16, args.output_len))
        measure_level(target, specs, top, math.inf, 0, pid, "warmup")
        if llm is not None:
            offline_batch(llm, work.specs(WARMUP_SEED, n=n_warm, output_len=min(16, args.output_len), ids=True, salt=1))
    return n_warm


def _sweep(args, levels: list[int | None], target: load.Target, work: Workload, server: Server | None, llm) -> dict:
    """Every level in every run (the offline side beside the top level, the two alternating); the figures."""
    pid = server.pid if server else args.server_pid
    rate = args.request_rate
    top = max(levels, key=lambda c: c or 0)
    n_warm = _warmup(args, top, target, work, pid, llm)
    per_level: list[list[dict]] = [[] for _ in levels]
    offline_runs: list[dict] = []
    for r in range(args.runs):
        for i, c in enumerate(levels):
            desc = f"run {r + 1}/{args.runs} concurrency {_level_name(c, rate)}"
            off = f"run {r + 1}/{args.runs} offline"
            seed = LEVEL_SEED * (r + 1) + 10 * i  # the level's lengths; every attempt and side draws its own prompts

            def through_server(attempt: int) -> dict:
                return measure_level(target, work.specs(seed, salt=2 * attempt), c, rate, seed + attempt, pid, desc)

            def offline(attempt: int) -> dict:
                return measure_offline(llm, work.specs(seed, ids=True, salt=2 * attempt + 1), pid, off)

            sides = [(per_level[i], through_server, desc)]
            if llm is not None and c == top:
                sides.append((offline_runs, offline, off))
            for runs, measure_once, what in sides if r % 2 == 0 else reversed(sides):
                runs.append(redone_if_contended(measure_once, pid, args.quiet_wait, what))
    result = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "random_range_ratio": args.random_range_ratio,
        "runs": args.runs,
        "warmup_prompts": n_warm,
        "quiet_wait": args.quiet_wait,
        "levels": [
            {
                "max_concurrency": c,
                "request_rate": None if math.isinf(rate) else rate,
                "runs": per_level[i],
                "median": median_level(per_level[i]),
            }
            for i, c in enumerate(levels)
        ],
    }
    if offline_runs:
        med = {
            k: _med([o[k] for o in offline_runs])
            for k in (
                "seconds",
                "prompt_tokens",
                "output_tokens",
                "output_throughput",
                "total_throughput",
                "request_throughput",
            )
        }
        result["offline"] = {"runs": offline_runs, "median": {**med, "cpu": _median_cpu(offline_runs)}}
    return result


# -- the report ----------------------------------------------------------------------------------------------


def _int(v) -> str:
    return "-" if v is None else f"{v:.0f}" if v == int(v) else f"{v:.1f}"


def _level_name(c: int | None, rate: float) -> str:
    parts = [f"{c}" if c else "unlimited"]
    if math.isfinite(rate):
        parts.append(f"@ {rate:g} req/s")
    return " ".join(parts)


def _dist_cell(d: dict) -> str:
    return " / ".join(fmt(d[f"p{q}"]) for q in load.PERCENTILES)


def _cpu_cell(c: dict) -> str:
    return " / ".join("-" if c.get(k) is None else f"{c[k]:.2f}" for k in ("server", "client", "others"))


def bars(result: dict) -> list[Bar]:
    out = []
    levels = result["levels"]
    off = result.get("offline")
    if off and levels:
        top = max(levels, key=lambda lv: lv["max_concurrency"] or 0)
        got = _med([r["stats"]["output_throughput"] / o["output_throughput"] for r, o in zip(top["runs"], off["runs"])])
        out.append(
            Bar(
                f"server output tok/s at concurrency {top['max_concurrency']} >= "
                f"{MIN_SERVER_OVER_OFFLINE_THROUGHPUT:.0%} of offline LLM.generate (same prompts count and "
                "lengths, same engine flags; median of per-run ratios)",
                ">=",
                MIN_SERVER_OVER_OFFLINE_THROUGHPUT,
                got,
                shown=f"{got:.0%} ({fmt(top['median']['output_throughput'])} / "
                f"{fmt(off['median']['output_throughput'])} tok/s)",
            )
        )
    at = next((lv["median"] for lv in levels if lv["max_concurrency"] == TTFT_JUDGED_AT_CONCURRENCY), None)
    if at is not None:
        got = at["ttft_ms"]["p50"]
        out.append(
            Bar(
                f"TTFT p50 at concurrency {TTFT_JUDGED_AT_CONCURRENCY} < {MAX_TTFT_P50_MS / 1000:g} s "
                f"({result['input_len']}-token prompts)",
                "<",
                MAX_TTFT_P50_MS,
                got,
                shown=f"{fmt(got)} ms",
                unmet=at["failed"] != 0,
            )
        )  # a TTFT over the requests that did not fail says little
    return out


def about(result: dict) -> list[str]:
    """What ran: the server, the engine, the workload, the client, the offline peer."""
    srv = result["server"]
    lines = [
        f"server: {srv['url']}, model `{srv['model']}`"
        + (f" (max_model_len {srv['max_model_len']})" if srv.get("max_model_len") else "")
        + (
            f"; launched as `{srv['command']}`, ready {srv['ready_s']:.1f}s after start (/health 200 and no "
            "background compile running)"
            if srv.get("command")
            else ""
        )
    ]
    if result.get("engine"):
        lines.append(f"ember engine (server and offline alike): {describe(result['engine'])}")
    lines.append(f"workload: {result['workload']}")
    lines.append(
        f"client: this process, asyncio + httpx, streaming; {result['runs']} run(s) after a warmup of "
        f"{result['warmup_prompts']} short requests; before each measurement wait up to "
        f"{result['quiet_wait']:g}s for other processes to leave the CPU idle"
        + (
            f"; a measurement during which they used > {CONTENDED_CORES} cores is redone with fresh prompts "
            f"(up to {RETRIES} times)"
            if srv.get("pid_known")
            else "; the server's pid is unknown (--server-pid), so its CPU use counts under others"
        )
    )
    if result.get("offline"):
        lines.append(
            f"peer: offline `LLM.generate` in the client process over {result['num_prompts']} fresh prompts "
            "of the same lengths (token ids, ignore_eos), same engine flags, measured right before or after "
            "the top concurrency level in every run (alternating), while the server idles"
        )
    return lines


def table(result: dict) -> list[str]:
    """A row per level (medians over runs), the offline row, the distinct errors of failed requests."""
    lines = [
        "| concurrency | ok / failed | prompt / output tokens | req/s | output tok/s | total tok/s | "
        "TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | "
        "e2e p50 / p90 / p99 (s) | CPU cores: server / client / others |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        md = lv["median"]
        lines.append(
            f"| {_level_name(lv['max_concurrency'], lv['request_rate'] or math.inf)} | {_int(md['completed'])} / "
            f"{_int(md['failed'])} | {_int(md['prompt_tokens'])} / {_int(md['output_tokens'])} | "
            f"{fmt(md['request_throughput'])} | {fmt(md['output_throughput'])} | {fmt(md['total_throughput'])} | "
            f"{_dist_cell(md['ttft_ms'])} | {_dist_cell(md['tpot_ms'])} | {_dist_cell(md['itl_ms'])} | "
            f"{_dist_cell(md['e2e_s'])} | {_cpu_cell(md['cpu'])} |"
        )
    off = result.get("offline")
    if off:
        md = off["median"]
        lines.append(
            f"| offline LLM.generate (max_num_seqs {result['engine'].get('max_num_seqs', '-')}) | "
            f"{result['num_prompts']} / 0 | {_int(md['prompt_tokens'])} / {_int(md['output_tokens'])} | "
            f"{fmt(md['request_throughput'])} | {fmt(md['output_throughput'])} | "
            f"{fmt(md['total_throughput'])} | - | - | - | {fmt(md['seconds'])} (whole batch) | "
            f"{_cpu_cell(md['cpu'])} (client = the offline engine) |"
        )
    errors = sorted({e for lv in result["levels"] for e in lv["median"]["errors"]})
    if errors:
        lines += ["", "Failed requests (first few distinct errors):", ""] + [f"- `{e}`" for e in errors]
    return lines


# -- the command ------------------------------------------------------------------------------------------

BENCH_FLAGS = [
    "url",
    "launch",
    "server_args",
    "server_pid",
    "served_model_name",
    "endpoint",
    "prompt_format",
    "num_prompts",
    "max_concurrency",
    "concurrency_list",
    "request_rate",
    "input_len",
    "output_len",
    "random_range_ratio",
    "ignore_eos",
    "extra_body",
    "runs",
    "warmup_prompts",
    "offline",
    "prompt_seed",
    "quiet_wait",
    "label",
    "output",
]


def command_line(args) -> str:
    """The command that reproduces the run: engine flags with --launch, the served model and tokenizer with
    --url, every flag here (on/off flags as typed), the API key hidden."""
    words = ["ember", "bench", "serve"]
    if args.launch:
        words += engine_args_to_words(args)
    else:
        for name in ("model", "tokenizer"):
            if getattr(args, name, None):
                words += ["--" + name, getattr(args, name)]
    for name in BENCH_FLAGS:
        v = getattr(args, name, None)
        flag = "--" + name.replace("_", "-")
        if v is None or v is False and name == "launch" or (name == "request_rate" and math.isinf(v)):
            continue
        if isinstance(v, bool):
            words.append(flag if v else "--no-" + name.replace("_", "-"))
        elif isinstance(v, list):
            words += [flag, ",".join(map(str, v))]
        elif name == "server_args":
            words.append(f"{flag}={v}")
        else:
            words += [flag, str(v)]
    if args.api_key:
        words += ["--api-key", "***"]
    return shlex.join(words)


def _check_args(args) -> None:
    from ember.config import EngineConfig

    if bool(args.url) == bool(args.launch):
        raise ConfigError("give exactly one of --url URL (a running server) and --launch (start `ember serve` here)")
    if args.launch and args.server_pid is not None:
        raise ConfigError("--server-pid is for --url; with --launch the server's pid is known")
    if not args.launch:
        given = [n for n in EngineConfig.field_names() if hasattr(args, n) and n not in ("model", "tokenizer")]
        if given or getattr(args, "model_pos", None):
            flags = ", ".join("--" + n.replace("_", "-") for n in given) or "MODEL"
            raise ConfigError(
                f"engine flags ({flags}) only apply with --launch; with --url the server was started with its own flags"
            )
    if args.max_concurrency is not None and args.concurrency_list is not None:
        raise ConfigError("give --max-concurrency N (one level) or --concurrency-list N,N,... (a sweep), not both")
    if not (args.request_rate > 0):
        raise ConfigError(f"--request-rate must be > 0 requests/s (got {args.request_rate}); inf = all at once")
    if not 0 <= args.random_range_ratio < 1:
        raise ConfigError(f"--random-range-ratio must be in [0, 1) (got {args.random_range_ratio})")
    if args.prompt_format == "ids" and args.endpoint == "chat":
        raise ConfigError("--prompt-format ids needs --endpoint completions: chat messages are text")


def _levels(args) -> list[int | None]:
    if args.concurrency_list:
        return list(args.concurrency_list)
    if args.max_concurrency is not None:
        return [args.max_concurrency]
    return list(DEFAULT_LAUNCH_LEVELS) if args.launch else [None]


def _extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--extra-body is not valid JSON ({e}); give an object like '{{\"top_k\": 1}}'") from None
    if not isinstance(body, dict):
        raise ConfigError(f"--extra-body must be a JSON object (got {type(body).__name__})")
    return body


def _slug(name: str) -> str:
    return (
        "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in os.path.basename(name.rstrip("/")))[:60]
        or "server"
    )


def _launch_config(args, levels: list[int | None]):
    """The engine config of --launch (validated before anything starts), max_num_seqs sized to the top level when
    the user left it unset (like `ember bench throughput`)."""
    from ember.config.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    top = max(c or 0 for c in levels)
    if config.max_num_seqs is None and top:
        args.max_num_seqs = min(top, config.max_num_batched_tokens or top)
        config = engine_config_from_args(args)
    return config


def launch(args) -> Server:
    """`ember serve` with the command's engine flags and --server-args on a free port (the API key hidden in the
    name it is reported by)."""
    port = free_port()
    extra = shlex.split(args.server_args or "") + (
        ["--served-model-name", args.served_model_name] if args.served_model_name else []
    )
    argv = serve_argv(engine_args_to_words(args), port) + extra + (["--api-key", args.api_key] if args.api_key else [])
    return Server(argv, port, shlex.join(["ember", "serve", *argv[4:]]).replace(args.api_key or "\0", "***"))


class Tokens:
    """Where the prompts' token ids come from: the offline engine (--launch), a tokenizer (--launch without
    --offline, --url with --tokenizer), or none (text prompts); and the ember engine's description."""

    def __init__(self, args, config=None):
        self.llm, self.engine, self.pool, self.tokenizer_name = None, {}, None, None
        if config is not None and args.offline:
            from ember.llm import LLM

            self.llm = LLM(**config.flags())
            self.llm.wait_for_compile()  # benchmarks measure the steady state: a background compile finishes first
            self.engine = describe_engine(self.llm)
            self.tokenizer_name = self.engine["model"].split(" (")[0]
            self.pool = ordinary_tokens(self.llm.get_tokenizer(), self.llm.engine.parts.loaded.model_config.vocab_size)
        elif config is not None:
            self.tokenizer_name = os.path.basename(
                str(config.tokenizer or config.model or "the default model").rstrip("/")
            )
            self.pool = ordinary_tokens(*load_tokenizer(config.tokenizer or config.model))
            self.engine = {"max_num_seqs": getattr(args, "max_num_seqs", None)}
        elif args.prompt_format != "text" and args.endpoint == "completions" and getattr(args, "tokenizer", None):
            self.pool = ordinary_tokens(*load_tokenizer(args.tokenizer))
            self.tokenizer_name = os.path.basename(args.tokenizer.rstrip("/"))
        elif args.prompt_format == "ids":
            raise ConfigError(
                "--prompt-format ids with --url needs --tokenizer PATH (the served model's folder or "
                ".gguf file) to draw ordinary token ids from"
            )


def main(args) -> None:
    _check_args(args)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger("httpx").getEffectiveLevel()))
    levels = _levels(args)
    load_at_start = load_average()
    server: Server | None = None
    try:
        ready_s = None
        if args.launch:
            config = _launch_config(args, levels)
            server = launch(args)
            tokens = Tokens(args, config)
            t0 = time.monotonic()  # ready: from here, once this process's own engine is built
            server.health(args.server_timeout, steady=True, poll=0.25)
            ready_s = time.monotonic() - t0
            logger.info("bench serve: server ready after %.1fs", ready_s)
        else:
            tokens = Tokens(args)
        run_and_publish(args, levels, server, ready_s, tokens, load_at_start)
    finally:
        if server is not None:
            server.stop(keep_log=True)
            logger.info("bench serve: server stopped (its log: %s)", server.log.name)


def run_and_publish(
    args,
    levels: list[int | None],
    server: Server | None,
    ready_s: float | None,
    tokens: Tokens,
    load_at_start: float | None,
) -> None:
    """Run the sweep against the server and publish its section and JSON file."""
    url = server.url if server else args.url
    target = load.Target(url, None, args.endpoint, args.api_key, args.ignore_eos, _extra_body(args.extra_body))
    card = asyncio.run(load.served_model(target))
    target.model = args.served_model_name or (getattr(args, "model", None) if not args.launch else None) or card["id"]
    use_ids = tokens.pool is not None and args.prompt_format != "text" and args.endpoint == "completions"
    work = Workload(args, target, tokens.pool, use_ids)
    work.calibrate()
    result = _sweep(args, levels, target, work, server, tokens.llm)
    label = args.label or ("ember" if args.launch else _slug(target.model))
    result.update(
        label=label,
        server={
            "url": url,
            "model": target.model,
            "max_model_len": card.get("max_model_len"),
            "command": server.command if server else None,
            "ready_s": ready_s,
            "pid_known": bool(server or args.server_pid),
        },
        engine=tokens.engine,
        workload=work.describe(tokens.tokenizer_name),
        prompt_format=work.kind,
        endpoint=args.endpoint,
    )
    title = (
        f"Serving: {label} ({target.model}), {args.num_prompts} requests per level, {args.input_len} in / "
        f"{args.output_len} out"
    )
    Result(
        f"serve:{label}",
        title,
        command_line(args),
        load_at_start,
        about(result),
        list(METHOD_NOTES),
        table(result),
        result,
        bars(result),
    ).publish(args.output, header=HEADER, json_file=json_path(args.output, label))


# -- the parser ---------------------------------------------------------------------------------------------


def add_cli_args(p) -> None:
    from ember.config.engine_args import add_engine_args

    add_engine_args(p)  # for --launch; --model / --tokenizer also name the served model / its tokenizer with --url
    _add_server_args(p.add_argument_group("server"))
    _add_workload_args(p.add_argument_group("workload"))
    _add_measurement_args(p.add_argument_group("measurement"))


def _add_server_args(g) -> None:
    g.add_argument("--url", default=None, help="base URL of a running OpenAI-compatible server (http://host:port)")
    g.add_argument(
        "--launch",
        action="store_true",
        help="start `ember serve` (with the engine flags given here) on a free local port, run, stop it",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model name sent in requests (default: --model with --url, else the first of /v1/models)",
    )
    g.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="with --url to a server on this machine: its process id, so its CPU use is reported apart "
        "from other processes' (and a measurement they disturbed is redone)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("EMBER_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="Bearer key (default: $EMBER_API_KEY or $OPENAI_API_KEY); with --launch the server requires it",
    )
    g.add_argument(
        "--server-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="with --launch: how long to wait for /health to answer 200",
    )
    g.add_argument(
        "--server-args",
        default=None,
        metavar="'FLAGS'",
        help="with --launch: extra `ember serve` flags that are not engine flags; write it with =, "
        "e.g. --server-args='--no-warmup'",
    )
    g.add_argument(
        "--offline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --launch: also measure offline LLM.generate in this process, same prompts count and "
        "lengths (the peer of the throughput bar)",
    )


def _add_workload_args(w) -> None:
    w.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    w.add_argument(
        "--prompt-format",
        choices=("auto", "ids", "text"),
        default="auto",
        help="ids = random ordinary token ids (needs a tokenizer: --launch, or --tokenizer with --url); "
        "text = random words sized with the server's usage counts; auto = ids when possible",
    )
    w.add_argument("--num-prompts", type=positive_int, default=64, help="requests per level")
    w.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="at most N requests in flight (one level; default: unlimited, or 1,8,32 with --launch)",
    )
    w.add_argument(
        "--concurrency-list",
        type=int_list,
        default=None,
        metavar="N,N,...",
        help="a sweep: one level per concurrency (default with --launch: 1,8,32)",
    )
    w.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals at R requests/s (default inf: all at once, limited by the concurrency)",
    )
    w.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens")
    w.add_argument("--output-len", type=positive_int, default=128, help="max_tokens of every request")
    w.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly from [len*(1-r), len*(1+r)] (vLLM's random dataset); 0 = fixed",
    )
    w.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos and min_tokens (ember/vLLM/llama.cpp) so every request runs to max_tokens",
    )
    w.add_argument("--extra-body", default=None, metavar="JSON", help="extra fields merged into every request body")
    w.add_argument("--prompt-seed", type=int, default=0, help="seed of the random prompts")


def _add_measurement_args(r) -> None:
    r.add_argument("--runs", type=positive_int, default=1, help="sweeps; every figure is the median over them")
    r.add_argument(
        "--warmup-prompts",
        type=int,
        default=None,
        help="short warmup requests at the top concurrency before measuring (default: that concurrency)",
    )
    r.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="before each measurement wait up to this long for other processes to leave the CPU idle",
    )
    r.add_argument(
        "--label",
        default=None,
        help="names this server's section and JSON file (default: ember with --launch, else the model)",
    )
    r.add_argument(
        "--output",
        default=DEFAULT_OUTPUT,
        help="markdown results file; this label's section is rewritten and <stem>-<label>.json written",
    )
