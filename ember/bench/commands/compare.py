"""`ember bench compare`: ember against llama.cpp and transformers, one run, same GGUF, same threads.

Sides (each in a worker process of its own, so its peak RSS is its own; see bench/sides/):
  - ember (the command's engine flags; by default packed GGUF weights, no speculation);
  - ember+MTP: the same with enable_mtp=True (the default model's trained MTP head), decode only;
  - llama.cpp through llama-cpp-python (the `bench` extra), same file and thread count;
  - transformers on the same file (dequantized by transformers on load), in bfloat16 where the CPU
    has bf16 instructions (AVX512-BF16), else float32, the dtype ember itself picks there.
Figures: batch-1 greedy decode (256 tokens, EOS ignored), TTFT at 512 and 2,000 prompt tokens,
offline throughput (64 prompts of 128-512 tokens, 128 out each, EOS ignored), peak RSS, and a
memory-bandwidth probe against which ember's decode (weight bytes x tok/s) is put. One warmup
round, then --runs rounds; in each round every side measures every figure on the same freshly
seeded prompts, the order of sides reversed every other round so drift favours no one. Ratios
are ember / peer per round (medians, min-max shown), and the issue's bars are judged on them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import subprocess
from typing import Callable

from ember.bench.lib import membw
from ember.bench.lib.args import add_common_args, add_workload_args, command_line, int_list, switches
from ember.bench.lib.bar import Bar
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import cell, cores_cell, describe, fmt, ratio_cell, row
from ember.bench.lib.prompts import chat_prompts, prompt_maker_of
from ember.bench.lib.result import Result
from ember.bench.lib.rounds import (
    decode_task,
    measure,
    paired_ratios,
    ratio_bar,
    spread,
    summarize_figures,
    throughput_task,
    ttft_key,
    ttft_task,
)
from ember.bench.peers import PEER_NAMES, PEERS
from ember.bench.sides.ember import NO_SPECULATION, ember_factory, ember_knobs
from ember.bench.sides.worker import start_side
from ember.platform import resolve_dtype_name

logger = logging.getLogger("ember.bench")

KIND = "compare"
TITLE = "ember vs llama.cpp vs transformers (same GGUF file, same threads)"
EMBER, MTP, BASELINE, VERSUS = "ember", "ember+MTP", "ember baseline", "ember --versus"
# --baseline: this checkout and another one must agree within this share on decode and throughput
BASELINE_TOLERANCE = 0.05
DEFAULT_PEERS = ["llamacpp", "hf"]
NAME = "compare"
HELP = "ember vs llama.cpp vs transformers on the same GGUF: decode, TTFT, throughput, memory; judges the CPU bars"
PARSER = {
    "description": "Needs llama-cpp-python for the llama.cpp side: pip install -e '.[bench]' -- installing it "
    "compiles llama.cpp, several minutes on 2 cores. --peer hf needs transformers and accelerate."
}


# -- bars and the table ---------------------------------------------------------------------------


def bars(figures: list[dict], ttft_len: int, baseline: bool = False, versus: bool = False) -> list[Bar]:
    """The issue's bars (with a baseline checkout: behaviour unchanged, within BASELINE_TOLERANCE; with
    --versus flags: the command's flags at least as fast at batch-1 decode, within it)."""
    tol = BASELINE_TOLERANCE
    if versus:
        specs = [(f"batch-1 decode >= {1 - tol:.2f}x the --versus flags'", "decode", EMBER, VERSUS, ">=", 1 - tol)]
    else:
        specs = (
            [
                (f"batch-1 decode within {tol:.0%} of the baseline checkout", "decode", EMBER, BASELINE, "within", tol),
                (
                    f"offline throughput within {tol:.0%} of the baseline checkout",
                    "throughput",
                    EMBER,
                    BASELINE,
                    "within",
                    tol,
                ),
            ]
            if baseline
            else []
        )
        specs += [
            ("batch-1 decode >= 1.0x llama.cpp, no speculation", "decode", EMBER, "llama.cpp", ">=", 1.0),
            ("batch-1 decode >= 1.5x llama.cpp with MTP", "decode", MTP, "llama.cpp", ">=", 1.5),
            (f"TTFT at {ttft_len} tokens <= 0.33x llama.cpp's", ttft_key(ttft_len), EMBER, "llama.cpp", "<=", 0.33),
            ("offline throughput >= 3x transformers' batched generate", "throughput", EMBER, "transformers", ">=", 3.0),
        ]
    return [ratio_bar(text, figures, *spec) for text, *spec in specs]


def _others(figure: dict, side: str) -> str:
    return cores_cell(figure["values"].get(side, {}).get("others", []))


def figure_rows(figures: list[dict], peers: list[str], last: Callable[[dict, str], str], skip=()) -> list[list[str]]:
    """A table row per figure and ember side (ember, ember+MTP): its cell, each peer's, its paired ratio
    to each peer, and last(figure, side)."""
    rows = []
    for f in figures:
        for side in (EMBER, MTP) if f["key"] not in skip else ():
            if side in f["values"]:
                cells = [f"{f['name']}{' with MTP' if side == MTP else ''} ({f['unit']})", cell(f["values"][side])]
                cells += [cell(f["values"].get(p)) for p in peers]
                rows.append(cells + [ratio_cell(paired_ratios(f, side, p)) for p in peers] + [last(f, side)])
    return rows


def rss_row(rss: dict, side: str, peers: list[str], last: str) -> list[str]:
    cells = [f"peak RSS{' with MTP' if side == MTP else ''} (MiB)", fmt(rss[side])] + [fmt(rss.get(p)) for p in peers]
    return cells + [f"{rss[side] / rss[p]:.2f}x" if rss.get(p) else "-" for p in peers] + [last]


def table(data: dict) -> list[str]:
    """The figures of every side, each ember side's ratio to every other, peak RSS, the bandwidth paragraph."""
    peers = [n for n in data["sides"] if n not in (EMBER, MTP)]
    columns = ["metric", EMBER] + peers + [f"{EMBER} / {p}" for p in peers] + ["others' cores (ember)"]
    lines = [row(columns), "|---|" + "---:|" * (len(columns) - 1)]
    lines += [row(cells) for cells in figure_rows(data["figures"], peers, _others)]
    rss = data["peak_rss_mib"]
    lines += [row(rss_row(rss, side, peers, "-")) for side in (EMBER, MTP) if side in rss]
    bw = data.get("bandwidth")
    if bw:
        lines += [
            "",
            f"Memory: read bandwidth {cell(bw['gbps'])} GB/s; ember's decode step reads "
            f"{bw['weight_bytes'] / 1e6:.1f} MB of weights per token, so it achieves "
            f"{cell(bw['achieved_gbps'])} GB/s = {cell(bw['percent'], '%')} of the bandwidth measured in "
            "the same rounds (round by round).",
        ]
    return lines


def bandwidth_summary(bandwidth: list[float], decode: dict, weight_bytes: int | None) -> dict | None:
    """Ember's achieved decode bytes/s against the bandwidth probe, round by round."""
    runs = decode.get("values", {}).get(EMBER, {}).get("runs", [])
    if not bandwidth or not weight_bytes or not runs:
        return None
    achieved = [weight_bytes * t / 1e9 for t in runs]
    return {
        "weight_bytes": weight_bytes,
        "gbps": {"runs": bandwidth, **spread(bandwidth)},
        "achieved_gbps": {"runs": achieved, **spread(achieved)},
        "percent": spread([100 * a / b for a, b in zip(achieved, bandwidth)]),
    }


# -- the command ----------------------------------------------------------------------------------


def peer_list(s: str) -> list[str]:
    if s == "none":
        return ["none"]  # kept as a word, so the command line in the report reads back as typed
    names = [x.strip() for x in s.split(",") if x.strip()]
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown peer {', '.join(bad)}: want a comma list of {', '.join(PEERS)}, or none"
        )
    return names


def check_peers_installed(peers: list[str]) -> None:
    """Fail before anything loads when llama-cpp-python is missing (the install hint says how)."""
    if "llamacpp" in peers and PEERS["llamacpp"].startswith("ember.bench.peers.llamacpp:"):
        from ember.bench.peers.llamacpp import import_llama_cpp

        import_llama_cpp()


def versus_knobs(args, knobs: dict) -> dict:
    """The command's engine knobs with --versus's engine flags on top (no speculation either)."""
    from ember.config.engine_args import add_engine_args

    parser = argparse.ArgumentParser(prog="ember bench compare --versus")
    add_engine_args(parser, positional_model=False)
    given = vars(parser.parse_args(shlex.split(args.versus)))  # engine flags default to SUPPRESS: only these
    ns = argparse.Namespace(**{**vars(args), **given})
    out, _ = ember_knobs(ns, args.num_prompts)
    out.update(NO_SPECULATION)
    for key in ("kv_cache_memory", "max_num_seqs"):  # sized alike unless --versus sets them
        if key not in given:
            out[key] = knobs[key]
    return out


def _check(args) -> None:
    from ember.errors import ConfigError

    if args.decode_tokens < 2:
        raise ConfigError(f"--decode-tokens must be >= 2 (got {args.decode_tokens})")
    if args.baseline is not None and (args.in_process or not os.path.isdir(os.path.join(args.baseline, "ember"))):
        raise ConfigError(
            f"--baseline {args.baseline!r} must be a checkout of ember (a folder holding ember/), "
            "measured in a worker process of its own (drop --in-process)"
        )
    check_peers_installed(args.peer)


def start_sides(sides: dict, args, knobs: dict, mtp_knobs: dict, threads: int, path: str) -> None:
    """Start every side into `sides` (the caller closes what started, whatever fails)."""
    lo, hi = args.input_len_range
    # a peer may read another file of the same weights (ember bench hybrid: the GGUF for llama.cpp, the HF folder
    # for transformers)
    peer_kwargs = {
        "llamacpp": {
            "gguf_path": getattr(args, "llamacpp_model", None) or path,
            "threads": threads,
            "n_ctx": max(4096, max(args.prompt_lens) + hi + args.output_len),
            "batch_mode": args.llamacpp_batch,
        },
        # transformers in the dtype ember picks here: bf16 where the CPU has bf16 instructions,
        # else float32 (emulated bf16 runs several times slower: no user would pick it)
        "hf": {"model_path": getattr(args, "hf_model", None) or path, "dtype": resolve_dtype_name("auto", "cpu")},
    }
    sides[EMBER] = start_side(ember_factory(), knobs, threads, args.in_process)
    if args.baseline is not None:  # the same flags through the other checkout's ember
        sides[BASELINE] = start_side(
            ember_factory(args.baseline), knobs, threads, False, os.path.abspath(args.baseline)
        )
        sides[BASELINE].description = {**sides[BASELINE].description, "checkout": checkout_of(args.baseline)}
    if args.versus is not None:  # the same checkout with other flags
        sides[VERSUS] = start_side(ember_factory(), versus_knobs(args, knobs), threads, args.in_process)
        sides[VERSUS].description = {**sides[VERSUS].description, "flags": args.versus}
    if args.mtp:
        sides[MTP] = start_side(ember_factory(), mtp_knobs, threads, args.in_process)
    for p in args.peer:
        if p != "none":
            sides[PEER_NAMES[p]] = start_side(PEERS[p], peer_kwargs[p], threads, args.in_process)


def command(args) -> str:
    words = command_line(
        args,
        [
            "runs",
            "peer",
            "output",
            "prompt_seed",
            "quiet_wait",
            "decode_tokens",
            "prompt_lens",
            "num_prompts",
            "input_len_range",
            "output_len",
            "bandwidth_mib",
            "llamacpp_batch",
            "decode_prompt",
            "baseline",
        ],
    )
    if args.versus is not None:
        words += " --versus " + shlex.quote(args.versus)
    return words + switches(args, mtp="--no-mtp")


def main(args) -> None:
    from ember.default_model import default_model_path

    _check(args)
    knobs, threads = ember_knobs(args, args.num_prompts)
    # the plain ember side never speculates (its bar is "without speculation"); the MTP side adds the model's head
    mtp_knobs = {**knobs, "speculative_config": None, "speculative_model": None, "enable_mtp": True}
    knobs.update(NO_SPECULATION)
    path = knobs["model"] or default_model_path()
    lo, hi = args.input_len_range
    sides = {}
    try:
        start_sides(sides, args, knobs, mtp_knobs, threads, path)
        maker = prompt_maker_of(sides[EMBER], args.prompt_seed)
        only_ember = frozenset({MTP})
        decode_prompt = chat_prompts(path) if args.decode_prompt == "chat" else None
        tasks = [
            decode_task(maker, args.decode_tokens, prompt=decode_prompt),
            *(ttft_task(maker, n, only_ember) for n in args.prompt_lens),
            throughput_task(maker, args.num_prompts, lo, hi, args.output_len, only_ember),
        ]
        load = load_average()
        results, bandwidth = measure(
            sides,
            tasks,
            runs=args.runs,
            quiet_wait_s=args.quiet_wait,
            bandwidth_mib=args.bandwidth_mib,
            desc="bench compare",
        )
        figures = summarize_figures([f for t in tasks for f in t.figures], results)
        shared = any(s.shared_process for s in sides.values())
        data = {
            "threads": threads,
            "runs": args.runs,
            "sides": {n: s.description for n, s in sides.items()},
            "figures": figures,
            "peak_rss_mib": {n: s.peak_rss_bytes() / (1 << 20) for n, s in sides.items()},
            "rss_shared_process": shared,
            "bandwidth": bandwidth_summary(bandwidth, figures[0], sides[EMBER].weight_bytes),
        }
    finally:
        for s in sides.values():
            s.close()
    judged = bars(figures, max(args.prompt_lens), args.baseline is not None, args.versus is not None)
    Result(
        getattr(args, "kind", KIND),
        getattr(args, "title", None) or TITLE,
        command(args),
        load,
        [f"{name}: {describe(d)}" for name, d in data["sides"].items()],
        notes(args, knobs, mtp_knobs, decode_prompt is not None, shared),
        table(data),
        data,
        judged if getattr(args, "judge", True) else [],
        "ember / peer",
    ).publish(args.output)


def checkout_of(folder: str) -> str:
    """The baseline checkout as `git describe` says it (commit and dirty state), else the folder."""
    try:
        out = subprocess.run(
            ["git", "-C", folder, "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10
        )
        return f"{out.stdout.strip()} ({folder})" if out.returncode == 0 else folder
    except OSError:
        return folder


def notes(args, knobs: dict, mtp_knobs: dict, chat_decode: bool, shared: bool) -> list[str]:
    """How each figure was measured, for the report."""
    from ember.bench.lib.timing import DECODE_PROMPT_LEN
    from ember.bench.peers.hf import BATCH_METHOD as HF_BATCH
    from ember.bench.peers.hf import TTFT_METHOD as HF_TTFT
    from ember.bench.peers.llamacpp import BATCH_METHODS as LLAMA_BATCH

    out = [
        f"{args.runs} measured rounds after 1 warmup round; cells are median [min-max]; ember / peer ratios are taken "
        "round by round, then summarized; every side sees the same prompts, new each round: seeded random ordinary "
        "tokens for TTFT and throughput" + (", a held-out chat request for decode" if chat_decode else ""),
        "decode: greedy, "
        + (
            f"{args.decode_tokens} tokens answering a chat request built from text the MTP head "
            "never trained on (ember.bench.lib.prompts.held_out_prompts, pydoc_split('eval') "
            "through the chat template), EOS ignored; "
            if chat_decode
            else f"{args.decode_tokens} tokens after a {DECODE_PROMPT_LEN}-token random prompt, EOS ignored; "
        )
        + "mean = (N - 1) / (last token time - first token time), which the bars use (with MTP a step brings several "
        "tokens at once, and the mean is what a user gets); steady = 1 / median gap between tokens, shown because a "
        "burst of other work stretches a few gaps but not the median",
        "TTFT: ember add_request() to its first token through the step loop; llama.cpp generate() to its first token; "
        "transformers: " + HF_TTFT.split(": ", 1)[1],
        f"throughput: ember one LLM.generate() over all prompts (max_num_seqs {knobs['max_num_seqs']}, KV cache "
        f"{knobs['kv_cache_memory']:g} GiB); " + LLAMA_BATCH[args.llamacpp_batch] + "; " + HF_BATCH,
        f"{MTP}: the ember side with enable_mtp=True ({'adaptive draft length' if knobs['adaptive_spec'] else 'draft length pinned'}"
        f", at most {mtp_knobs['num_speculative_tokens'] or 'the default number of'} tokens); measured on decode only",
        (
            "peak RSS: all sides ran in this one process (--in-process), so it is the process's high-water mark, "
            "not attributable"
            if shared
            else "peak RSS: each side ran in a worker process of its own (python -m ember.bench.sides.worker); its "
            "resource.getrusage high-water mark, which includes the Python interpreter and imported libraries, and "
            "ember's preallocated KV pool"
        ),
    ]
    if args.versus is not None:
        out.append(
            f"{VERSUS}: this checkout with `{args.versus}` on top of the command's flags, measured in the same "
            "rounds, alternating with the others (each ember side's background compile, if any, finished first)"
        )
    if args.baseline is not None:
        out.append(
            f"{BASELINE}: the same flags through the ember of the checkout {args.baseline} (its worker imports "
            "ember from there), measured in the same rounds, alternating with the others"
        )
    if args.bandwidth_mib:
        out.append(
            membw.METHOD.format(mib=args.bandwidth_mib) + "; achieved = weight bytes as loaded "
            "(engine.parts.loaded.weight_bytes) x ember's decode tok/s"
        )
    return out


def add_cli_args(p) -> None:
    add_common_args(
        p,
        {
            "type": peer_list,
            "default": list(DEFAULT_PEERS),
            "metavar": "PEER,PEER|none",
            "help": "llamacpp = llama.cpp through llama-cpp-python (pip install -e '.[bench]'; compiles "
            "llama.cpp on install, several minutes), hf = transformers bf16; none = ember only",
        },
    )
    p.add_argument(
        "--prompt-lens",
        type=int_list,
        default=[512, 2000],
        metavar="N,N,...",
        help="prompt lengths for TTFT; the bar is judged at the longest",
    )
    p.add_argument("--no-mtp", dest="mtp", action="store_false", help="leave out the ember+MTP side")
    p.add_argument(
        "--decode-prompt",
        choices=("chat", "random"),
        default="chat",
        help="what the batch-1 decode figure answers: chat = a held-out chat request (what speculation is "
        "for: its speed depends on the text), random = 32 random tokens (the text says nothing)",
    )
    p.add_argument(
        "--llamacpp-batch",
        choices=("parallel", "sequential"),
        default="parallel",
        help="llama.cpp's offline throughput: parallel = all prompts as sequences of one llama_decode batch "
        "(llama.cpp's batch API; llama-cpp-python's generate() has none), sequential = one after another",
    )
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the memory-bandwidth probe (0 = skip it)")
    p.add_argument(
        "--versus",
        default=None,
        metavar="FLAGS",
        help="also measure this checkout with these engine flags on top of the command's (e.g. "
        "'--executor compiled --compilation-config {\"compile_sizes\":[1]}'), alternating in the same "
        "rounds; judges the command's batch-1 decode at least theirs (within the baseline tolerance)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also measure the ember of another checkout (e.g. a git worktree of an earlier commit) with "
        "the same flags, alternating in the same rounds; judges decode and throughput within "
        f"{BASELINE_TOLERANCE:.0%}% of it",
    )  # %% for argparse
    add_workload_args(p, prompt_help="for quick checks")
