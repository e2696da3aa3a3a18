"""`ember bench flash`: a random Qwen3.8-Flash-Next (qwen4_exp) of the release's proportions at 2 cores' scale
(ember.bench.lib.flash_model), as a user gets it from llama.cpp's tools, run by ember and by llama.cpp on the
same files: Q8_0 and Q4_K_M by llama.cpp's quantizer, and a low-bit mix of IQ and K types like the UD-Q2_K_XL files
unsloth publishes for this model (flash_model.FTYPES, llamacpp_convert.MIXES: which tensor gets which type).

It runs `ember bench hybrid`'s rounds (ember.bench.commands.hybrid.run_file: batch-1 decode, TTFT at 2,000
tokens, 16-sequence throughput against llama.cpp's best batched configuration, peak RSS, the achieved share of
the measured read bandwidth, the per-op split of one decode step by qwen4_exp's own kinds of work), and one
figure of its own: the n-gram table's resident bytes in each side's process after a 2,000-token prompt and
256 decoded tokens (ember.bench.lib.residency: the present pages of the side's mappings of the file's table
range; rows read by pread are in the page cache, not the process). Issue 55's bars are judged per file.

With --mtp (the default) the Q4_K_M file also gets an "ember+MTP" side: ember with a random MTP layer for the
model (flash_model.build_mtp_folder: llama.cpp's converter writes none, so it is attached from its own folder
as `--speculative-config '{"method": "mtp", "model": DIR}'` would), taking the batch-1 decode rounds with
adaptive k; its head is random, so its drafts are rejected and the row says what speculation costs when it
cannot pay. After the rounds, the cost of a draft step is measured on its own (EmberSide.draft_cost: k
pinned at 1) against a decode step of the plain side on the same prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from ember.bench.commands import compare, hybrid
from ember.bench.lib import flash_model, op_split
from ember.bench.lib.args import add_common_args, add_workload_args, int_list
from ember.bench.lib.bar import Bar
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import cell, describe, fmt, ratio_cell, row
from ember.bench.lib.result import Result
from ember.bench.lib.rounds import paired_ratios, ratio_bar, ttft_key
from ember.bench.lib.timing import DECODE_PROMPT_LEN
from ember.bench.sides.ember import NO_SPECULATION, ember_knobs

logger = logging.getLogger("ember.bench")

NAME = KIND = "flash"
HELP = (
    "a random Qwen3.8-Flash-Next-shaped (qwen4_exp) model in Q8_0, Q4_K_M and a UD-Q2_K_XL-like IQ mix (llama.cpp's converter "
    "and quantizer): ember vs llama.cpp on each file, the n-gram table's resident bytes, a per-op split"
)
PARSER = compare.PARSER
TITLE = (
    "flash: a random Qwen3.8-Flash-Next-shaped model (qwen4_exp), ember and llama.cpp on the same GGUF files "
    "(llama.cpp's converter and quantizer), same threads"
)
EMBER, LLAMA = hybrid.EMBER, hybrid.LLAMA
FILES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "ud_q2_k_xl": "UD-Q2_K_XL mix"}
# issue 55's bars: batch-1 decode against llama.cpp per file; TTFT, throughput and peak RSS ratios; the
# n-gram table's resident share after the long prompt and 256 decoded tokens (%)
DECODE_BAR = {"q8_0": 1.0, "q4_k_m": 1.2, "ud_q2_k_xl": 1.0}
TTFT_BAR, THROUGHPUT_BAR, RSS_BAR, TABLE_BAR = 0.5, 2.0, 1.0, 10.0
TABLE_TENSOR = "per_layer_token_embd.weight"
TABLE_DECODE = 256
# the ember side with the model's MTP layer (--mtp), on this file only; its drafts at most (adaptive k: 0..2)
MTP, MTP_FILE, MTP_TOKENS = "ember+MTP", "q4_k_m", 2


def cache_root() -> str:
    return hybrid.cache_root()


def model_folder(args) -> str:
    return flash_model.build_folder(args.model_dir or os.path.join(cache_root(), "qwen3.8-flash-shape-random"))


def build_bf16(folder: str) -> str:
    """The converter's bf16 file, its compress ratios set as a correct conversion writes them."""
    from ember.bench.peers.llamacpp_convert import convert, set_metadata_ints

    out = folder.rstrip("/") + ".bf16.gguf"
    if not os.path.exists(out):
        convert(folder, out + ".partial", "bf16")
        with open(os.path.join(folder, "config.json")) as f:
            ratios = flash_model.compress_ratios(json.load(f))
        set_metadata_ints(out + ".partial", "qwen4exp.attention.compress_ratios", ratios)
        os.replace(out + ".partial", out)
    return out


def build_file(folder: str, kind: str, threads: int = 0) -> str:
    """The GGUF file of type `kind` (a FILES key), by llama.cpp's quantizer from the bf16 file (once)."""
    from ember.bench.peers.llamacpp_convert import MIXES, quantize, quantize_mix

    out = f"{folder.rstrip('/')}.{kind}.gguf"
    if not os.path.exists(out):
        ftype = flash_model.FTYPES[kind]
        if ftype in MIXES:
            quantize_mix(build_bf16(folder), out + ".partial", ftype, threads)
        else:
            quantize(build_bf16(folder), out + ".partial", ftype, threads)
        os.replace(out + ".partial", out)
    return out


def table_range(path: str) -> tuple[int, int]:
    """(file offset, bytes) of the n-gram table's data in a GGUF file."""
    from ember.loader.gguf import GGUFCheckpoint

    t = next(t for t in GGUFCheckpoint(path)._reader.tensors if t.name == TABLE_TENSOR)
    return int(t.data_offset), int(t.n_bytes)


def token_bytes(path: str) -> int:
    """The file's bytes a batch-1 decode token reads, which the achieved-bandwidth row divides by the step:
    every tensor whole but the routed experts (k of E of each `_exps` tensor) and the row-read tables (the
    token embedding's one row, the n-gram table's row a head: (ngram_size - 1) x heads_per_ngram)."""
    from ember.loader.gguf import GGUFCheckpoint

    ck = GGUFCheckpoint(path)
    cfg = ck.config
    rows_read = {TABLE_TENSOR: (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"], "token_embd.weight": 1}
    total = 0
    for t in ck._reader.tensors:
        n = int(t.n_bytes)
        if t.name in rows_read:  # rows of shape[0] elements
            n = rows_read[t.name] * n * int(t.shape[0]) // int(t.n_elements)
        elif "_exps." in t.name:
            n = n * cfg["num_experts_per_tok"] // cfg["num_experts"]
        total += n
    return total


def table_probe(path: str, prompt_len: int, decode: int):
    """run_file's `after`: each side decodes `decode` tokens after a prompt_len-token prompt, then the
    table's resident bytes in its process are read from outside it."""
    from ember.bench.lib.residency import resident_bytes

    offset, length = table_range(path)

    def after(sides: dict, maker) -> dict:
        prompt = maker.make(1, prompt_len, hybrid.SPLIT_SEED + 1)[0]
        out = {}
        for name, side in sides.items():
            if name == MTP:  # ember again, with its MTP layer: the figure is ember's and llama.cpp's
                continue
            side.decode(prompt, decode)
            pid = getattr(side, "pid", None) or os.getpid()  # an --in-process side is this process
            out[name] = resident_bytes(pid, path, offset, length)
        shared = sides[EMBER].shared_process
        return {"table": {"bytes": length, "resident": out, "decoded": decode, "shared_process": shared}}

    return after


def mtp_sides(mtp_dir: str | None, kind: str) -> dict | None:
    """run_file's decode_sides: the ember+MTP side on MTP_FILE when there is an MTP folder."""
    if mtp_dir is None or kind != MTP_FILE:
        return None
    spec = {"method": "mtp", "model": mtp_dir, "num_speculative_tokens": MTP_TOKENS}
    return {MTP: {"speculative_config": spec}}


def mtp_probe(decode: int):
    """run_file's `after` for the MTP side: a draft step's cost, measured on its own (EmberSide.draft_cost),
    over a decode step of the plain ember side on the same prompt, just before."""

    def after(sides: dict, maker) -> dict:
        if MTP not in sides:
            return {}
        prompt = maker.make(1, DECODE_PROMPT_LEN, hybrid.SPLIT_SEED + 2)[0]
        times = sides[EMBER].decode(prompt, decode)
        cost = sides[MTP].call("draft_cost", prompt, decode)
        cost["decode_step_ms"] = 1000 * (times[-1] - times[0]) / max(1, len(times) - 1)
        cost["fraction"] = cost["draft_ms"] / cost["decode_step_ms"] if cost["draft_ms"] else None
        return {"mtp": cost}

    return after


def both(*hooks):
    """run_file's `after` running each hook in turn, their figures in one dict."""
    return lambda sides, maker: {k: v for hook in hooks for k, v in hook(sides, maker).items()}


def mtp_lines(files: dict) -> list[str]:
    """The ember+MTP side's rows: its decode against ember's and llama.cpp's (round by round), the drafting
    of its rounds, and a draft step's measured cost against a decode step's and the engine's estimate."""
    lines = []
    for d in files.values():
        cost, fig = d.get("mtp"), d["figures"][0]
        if not cost:
            continue
        r = cost["rounds"]
        ratios = [ratio_cell(paired_ratios(fig, MTP, peer)) for peer in (EMBER, LLAMA)]
        draft = "-" if cost["draft_ms"] is None else f"{cost['draft_ms']:.2f}"
        share = "-" if cost["fraction"] is None else f"{cost['fraction']:.2f}"
        drafted = f"{r['num_drafts']} ({r['num_draft_tokens']} drafts, {r['num_accepted_tokens']} accepted)"
        cells = [d["type"], f"{fig['name']} (tok/s)", cell(fig["values"].get(MTP)), *ratios, drafted]
        lines.append(row(cells + [draft, f"{cost['decode_step_ms']:.2f}", share, f"{cost['estimate']:.2f}"]))
    if not lines:
        return []
    head = [
        "file",
        "metric",
        MTP,
        f"{MTP} / {EMBER}",
        f"{MTP} / {LLAMA}",
        "steps that drafted in the rounds",
        "draft step (ms)",
        "decode step (ms)",
        "draft step / decode step",
        "engine's estimate",
    ]
    title = "The MTP layer (random: its drafts are rejected; adaptive k, at most 2 drafts a step):"
    return ["", title, "", row(head), "|---|---|" + "---:|" * (len(head) - 2)] + lines


def file_bars(kind: str, d: dict, ttft_len: int, n: int) -> list[Bar]:
    name, figures = FILES[kind], d["figures"]
    mode = (d.get("llamacpp_batch") or {}).get("mode", "-")
    specs = [
        (f"{name}: batch-1 decode >= {DECODE_BAR[kind]}x llama.cpp", "decode", ">=", DECODE_BAR[kind]),
        (f"{name}: TTFT at {ttft_len} tokens <= {TTFT_BAR}x llama.cpp's", ttft_key(ttft_len), "<=", TTFT_BAR),
        (f"{name}: {n}-sequence throughput >= {THROUGHPUT_BAR:.0f}x llama.cpp's best batched ({mode})", "throughput")
        + (">=", THROUGHPUT_BAR),
    ]
    bars = [ratio_bar(text, figures, key, EMBER, LLAMA, op, t) for text, key, op, t in specs]
    rss = d["peak_rss_mib"]
    ratio = rss[EMBER] / rss[LLAMA] if rss.get(LLAMA) and not d["rss_shared_process"] else None
    missing = "all sides in one process (--in-process)" if d["rss_shared_process"] else "no llama.cpp side"
    bars.append(Bar(f"{name}: peak RSS <= {RSS_BAR}x llama.cpp's", "<=", RSS_BAR, ratio, missing=missing))
    table = d.get("table")
    share = 100 * table["resident"][EMBER] / table["bytes"] if table and not table["shared_process"] else None
    bars.append(
        Bar(
            f"{name}: the n-gram table's resident bytes < {TABLE_BAR:.0f}% of its size after a {ttft_len}-token "
            f"prompt and {table['decoded'] if table else '-'} decoded tokens",
            "<",
            TABLE_BAR,
            share,
            shown=f"{share:.2f}%" if share is not None else None,
            missing="all sides in one process (--in-process)",
        )
    )
    for b in bars:
        b.on = {"file": kind, **(b.on or {})}
    return bars


def table_lines(files: dict) -> list[str]:
    lines = [row(["file", "table (MiB)", *[f"{s} resident (MiB, %)" for s in (EMBER, LLAMA)]]), "|---|---:|---:|---:|"]
    for d in files.values():
        t = d.get("table")
        if not t:
            continue
        cells = [
            f"{fmt(t['resident'][s] / (1 << 20))} ({100 * t['resident'][s] / t['bytes']:.2f}%)"
            if s in t["resident"]
            else "-"
            for s in (EMBER, LLAMA)
        ]
        lines.append(row([d["type"], fmt(t["bytes"] / (1 << 20)), *cells]))
    return lines


def notes(args, knobs: dict, shared: bool) -> list[str]:
    out = hybrid.notes(args, knobs, shared, user_cache=True, user_snapshots=True)
    out[0] = (
        "files: bf16 by llama.cpp's convert_hf_to_gguf.py from the random HF folder (ember.bench.lib.flash_model: "
        "the release's proportions at 2 cores' scale; attention.compress_ratios set to what a correct conversion "
        "writes), then Q8_0, Q4_K_M and the IQ/Q2_K mix by llama.cpp's llama_model_quantize from it "
        f"({flash_model.MIX_NOTE}); each built once and reused"
    )
    at = next(i for i, line in enumerate(out) if line.startswith("per-op split"))
    out[at] = op_split.QWEN4_METHOD.format(steps=args.split_steps, prompt=DECODE_PROMPT_LEN)
    out.append(
        f"n-gram table: after the rounds each side decodes {args.table_decode} tokens after a {max(args.prompt_lens)}-token "
        "prompt; then the present pages of its process's mappings of the table's byte range are counted "
        "(/proc/PID/pagemap; ember.bench.lib.residency)"
    )
    if args.mtp:
        out.append(MTP_NOTE.format(tokens=MTP_TOKENS, n=args.decode_tokens, prompt=DECODE_PROMPT_LEN))
    return out


MTP_NOTE = (
    "ember+MTP (Q4_K_M only): ember with a random MTP layer attached from its own folder (flash_model."
    "build_mtp_folder, by qwen4_exp's Qwen4ExpMTP, in the format train-mtp writes; the converter writes none), "
    "adaptive k up to {tokens} drafts, in the batch-1 decode rounds only; ratios round by round. Draft step: after "
    "the rounds, {n} tokens after a {prompt}-token prompt with k pinned at 1, the drafter's time (the fill of the "
    "step's rows through the MTP layer, and the draft through its mixer and the model's head) over its drafts, from "
    "the first token on; decode step: the plain ember side's mean gap on the same prompt just before; the engine's "
    "estimate is its draft_token_cost (the draft's weight bytes over the model's), which adaptive k prices with"
)


def main(args) -> None:
    from ember.errors import ConfigError

    if getattr(args, "model", None) is not None or getattr(args, "model_pos", None) is not None:
        raise ConfigError("ember bench flash runs the files it builds (--model-dir, --files), not --model")
    compare.check_peers_installed(args.peer)
    folder = model_folder(args)
    paths = {kind: build_file(folder, kind) for kind in args.files}
    logger.info("bench flash: %s", ", ".join(paths.values()))
    args.model = paths[args.files[0]]
    knobs, threads = ember_knobs(args, args.num_prompts)
    knobs.update(NO_SPECULATION)
    knobs.setdefault("max_state_snapshots", 0)  # like for like: llama.cpp keeps none and no prompt repeats
    if knobs.get("kv_cache_memory") is None:
        knobs["kv_cache_memory"] = hybrid.workload_cache_gib(args, paths[args.files[0]], knobs)
    mtp_dir = flash_model.build_mtp_folder(folder) if args.mtp and MTP_FILE in paths else None
    load = load_average()
    files = {}
    for kind, path in paths.items():
        after = both(table_probe(path, max(args.prompt_lens), args.table_decode), mtp_probe(args.decode_tokens))
        files[kind] = hybrid.run_file(
            args, kind, path, folder, knobs, threads, FILES[kind], after, NAME, mtp_sides(mtp_dir, kind),
            token_bytes=token_bytes(path),
        )  # fmt: skip
    peers = list(dict.fromkeys(n for d in files.values() for n in d["sides"] if n not in (EMBER, MTP)))
    shared = any(d["rss_shared_process"] for d in files.values())
    judged = [b for kind, d in files.items() for b in file_bars(kind, d, max(args.prompt_lens), args.num_prompts)]
    about = [f"{FILES[k]} {n}: {describe(s)}" for k, d in files.items() for n, s in d["sides"].items()]
    lines = hybrid.table(files, peers) + mtp_lines(files)
    lines += ["", "The n-gram table's resident bytes in each process:", ""]
    data = {"threads": threads, "runs": args.runs, "model_folder": folder, "shape": flash_model.FLASH_SMALL}
    data["files"] = files
    Result(
        KIND, TITLE, command(args), load, about, notes(args, knobs, shared), lines + table_lines(files), data, judged
    ).publish(args.output)


def command(args) -> str:
    from ember.bench.lib.args import command_line, switches

    flags = ["runs", "peer", "files", "model_dir", "output", "prompt_seed", "quiet_wait", "decode_tokens"]
    flags += ["prompt_lens", "num_prompts", "input_len_range", "output_len", "bandwidth_mib", "llamacpp_batch"]
    return command_line(args, flags + ["split_steps", "table_decode"]) + switches(args, mtp="--no-mtp")


def file_list(s: str) -> list[str]:
    names = list(dict.fromkeys(x.strip().lower() for x in s.split(",") if x.strip()))
    if not names or any(n not in FILES for n in names):
        raise argparse.ArgumentTypeError(f"want a comma list of {', '.join(FILES)} (got {s!r})")
    return names


def add_cli_args(p) -> None:
    add_common_args(
        p,
        {
            "type": compare.peer_list,
            "default": ["llamacpp"],
            "metavar": "PEER|none",
            "help": "llamacpp = llama.cpp through llama-cpp-python on each file; none = ember only",
        },
    )
    p.add_argument("--files", type=file_list, default=list(FILES), metavar="TYPE,TYPE", help=", ".join(FILES))
    p.add_argument("--model-dir", default=None, help="where the random HF folder is (built there if missing)")
    p.add_argument("--prompt-lens", type=int_list, default=[2000], metavar="N,N,...", help="TTFT prompt lengths")
    p.add_argument("--llamacpp-batch", choices=("best", *hybrid.BATCH_MODES), default="best")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the memory-bandwidth probe (0 = skip it)")
    p.add_argument("--split-steps", type=int, default=8, help="decode steps of the per-op split (0 = no split)")
    p.add_argument(
        "--table-decode",
        type=int,
        default=TABLE_DECODE,
        help="tokens each side decodes after the longest TTFT prompt before the n-gram table's residency is read",
    )
    p.add_argument(
        "--mtp",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="an ember+MTP side on the Q4_K_M file (a random MTP layer, built once beside the model folder): "
        "batch-1 decode with adaptive k, and a draft step's cost",
    )
    add_workload_args(p, prompt_help="for quick checks")
    p.set_defaults(output="benchmarks/flash.md", num_prompts=16, decode_tokens=64, output_len=128, max_model_len=4096)
