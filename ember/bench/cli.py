"""`ember bench latency | throughput`: measure ember and its peer side by side, write the results.

Every engine flag works here too (the same generated set as `ember serve`), so a tuned
configuration can be benchmarked exactly as it will be served.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import shlex

from ember.engine_args import add_engine_args, engine_args_to_words, engine_config_from_args

logger = logging.getLogger("ember.bench")

DEFAULT_OUTPUT = "benchmarks/cpu.md"


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {v})")
    return v


def _int_list(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"want comma-separated integers like 128,512,2048 (got {s!r})") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"want one or more integers >= 1 (got {s!r})")
    return vals


def _common_args(p: argparse.ArgumentParser) -> None:
    add_engine_args(p)
    g = p.add_argument_group("benchmark")
    g.add_argument("--runs", type=_positive_int, default=3, help="measured runs after one warmup; medians are reported")
    g.add_argument("--peer", choices=("hf", "none"), default="hf",
                   help="hf = Hugging Face transformers on the same weights (bf16), measured in the same run")
    g.add_argument("--output", default=DEFAULT_OUTPUT,
                   help="markdown results file; this benchmark's section is rewritten and a JSON file "
                        "<stem>-<kind>.json is written next to it")
    g.add_argument("--prompt-seed", type=int, default=0,
                   help="seed of the random prompts (both sides get the same ones; change it for another sample)")
    g.add_argument("--quiet-wait", type=float, default=30.0, metavar="SECONDS",
                   help="before each measured ember/peer pair, wait up to this long for other processes to leave "
                        "the CPU idle (0 = don't wait); what they used during each measurement is reported either way")


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser("bench", help="benchmark ember against transformers and write a results file")
    sub = p.add_subparsers(dest="bench_command", required=True, metavar="{latency,throughput,serve,quant,spec,tp,compare,hybrid,matrix,readme-table,restart,startup,structured}")

    lat = sub.add_parser("latency", help="batch-1 decode tok/s and time to first token")
    _common_args(lat)
    lat.add_argument("--decode-tokens", type=int, default=128, help="tokens generated for the decode figure (>= 2)")
    lat.add_argument("--prompt-lens", type=_int_list, default=[128, 512, 2048], metavar="N,N,...",
                     help="prompt lengths for TTFT")
    lat.set_defaults(func=cmd_latency)

    thr = sub.add_parser("throughput", help="offline batched generation tok/s")
    _common_args(thr)
    thr.add_argument("--num-prompts", type=_positive_int, default=32)
    thr.add_argument("--input-len", type=_positive_int, default=128)
    thr.add_argument("--output-len", type=_positive_int, default=128)
    thr.set_defaults(func=cmd_throughput)

    from ember.bench.compare import add_compare_parser
    from ember.bench.hybrid import add_hybrid_parser
    from ember.bench.matrix import add_matrix_parser
    from ember.bench.quant import add_quant_parser
    from ember.bench.readme_table import add_readme_table_parser
    from ember.bench.serve import add_serve_parser
    from ember.bench.spec import add_spec_parser
    from ember.bench.restart import add_restart_parser
    from ember.bench.startup import add_startup_parser
    from ember.bench.structured import add_structured_parser
    from ember.bench.tp import add_tp_parser

    add_serve_parser(sub)
    add_quant_parser(sub)
    add_spec_parser(sub)
    add_tp_parser(sub)
    add_compare_parser(sub)
    add_hybrid_parser(sub)
    add_matrix_parser(sub)
    add_readme_table_parser(sub)
    add_restart_parser(sub)
    add_startup_parser(sub)
    add_structured_parser(sub)


# -- the command line as run --------------------------------------------------------------------

def _command(args, bench_flags: list[str]) -> str:
    """The full command that reproduces this run: every benchmark flag with its value, plus the
    engine flags that were given (engine flags default to SUPPRESS, so present = given)."""
    words = ["ember", "bench", args.bench_command] + engine_args_to_words(args)
    for name in bench_flags:
        v = getattr(args, name)
        words += ["--" + name.replace("_", "-"), ",".join(map(str, v)) if isinstance(v, list) else str(v)]
    return shlex.join(words)


# -- building the two sides ---------------------------------------------------------------------

def _build(args, batch: int | None = None):
    """(LLM, peer or None, the ember description for the report). `batch` sets max_num_seqs
    when the user left it unset (capped by the step budget, as the engine requires)."""
    from ember.llm import LLM

    config = engine_config_from_args(args)
    if batch is not None and config.max_num_seqs is None:
        config = dataclasses.replace(config, max_num_seqs=min(batch, config.max_num_batched_tokens))
    llm = LLM(**config.flags())
    llm.wait_for_compile()  # benchmarks measure the steady state: a background compile finishes first
    engine = llm.engine
    # the peer loads after ember so it runs on the thread count ember chose (torch's is per-process)
    peer = None
    if args.peer == "hf":
        from ember.bench.hf_peer import HFPeer

        peer = HFPeer(str(engine.loaded.path))
    import torch

    ember_desc = {
        "model": f"{_basename(engine.loaded.path)} ({engine.loaded.weight_bytes / 1e6:.0f} MB weights{engine.copies_note()})",
        "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device),
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "prefix_caching": config.enable_prefix_caching,
        "enforce_eager": config.enforce_eager,
        "executor": engine.executor_name,
        "threads": torch.get_num_threads(),
    }
    return llm, peer, ember_desc


def _basename(path) -> str:
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def _protocol_note(args) -> str:
    from ember.bench.report import CONTENDED_CORES
    from ember.bench.throughput import RETRIES

    return (f"before each measured pair: wait up to {args.quiet_wait:g}s for other processes to leave the CPU idle; "
            f"a pair during which they used > {CONTENDED_CORES} cores is redone (up to {RETRIES} times)")


def _finish(result, output: str) -> None:
    from ember.bench import report

    md, js = report.write(result, output)
    print(report.render_section(result))
    logger.info("bench: wrote %s and %s", md, js)


def cmd_latency(args) -> None:
    from ember.bench import hf_peer, latency
    from ember.bench.report import Result, load_average
    from ember.errors import ConfigError

    if args.decode_tokens < 2:
        raise ConfigError(f"--decode-tokens must be >= 2 to time decode after the first token (got {args.decode_tokens})")
    llm, peer, ember_desc = _build(args)
    load = load_average()
    metrics = latency.run(llm, peer, decode_tokens=args.decode_tokens, prompt_lens=args.prompt_lens, runs=args.runs,
                          quiet_wait_s=args.quiet_wait, prompt_seed_base=args.prompt_seed)
    notes = [_protocol_note(args), latency.DECODE_METHOD, latency.RATES_METHOD, latency.TTFT_METHOD,
             f"decode uses a {latency.DECODE_PROMPT_LEN}-token prompt; all prompts are seeded random ordinary tokens, "
             "new each run"]
    if peer:
        notes += [hf_peer.DECODE_METHOD, hf_peer.TTFT_METHOD]
    result = Result("latency", "Latency (batch 1)", _command(args, ["runs", "peer", "output", "prompt_seed", "quiet_wait", "decode_tokens", "prompt_lens"]),
                    args.runs, metrics, latency.bars(args.decode_tokens, args.prompt_lens), ember_desc,
                    peer.description if peer else None, notes, load)
    _finish(result, args.output)


def cmd_throughput(args) -> None:
    from ember.bench import hf_peer, throughput
    from ember.bench.report import Result, load_average

    # the peer runs all prompts as one batch; give ember the same batch unless told otherwise
    llm, peer, ember_desc = _build(args, batch=args.num_prompts)
    load = load_average()
    metrics = throughput.run(llm, peer, num_prompts=args.num_prompts, input_len=args.input_len,
                             output_len=args.output_len, runs=args.runs, quiet_wait_s=args.quiet_wait,
                             prompt_seed_base=args.prompt_seed)
    notes = [_protocol_note(args), "ember: one LLM.generate() over all prompts (ignore_eos), tok/s over the whole call",
             f"{args.num_prompts} seeded random prompts of ordinary tokens, new each run, "
             f"{args.input_len} in / {args.output_len} out each"]
    if peer:
        notes.append(hf_peer.BATCH_METHOD)
    result = Result("throughput", "Throughput (offline batch)",
                    _command(args, ["runs", "peer", "output", "prompt_seed", "quiet_wait", "num_prompts", "input_len", "output_len"]), args.runs,
                    metrics, throughput.bars(args.num_prompts, args.input_len, args.output_len), ember_desc,
                    peer.description if peer else None, notes, load)
    _finish(result, args.output)
