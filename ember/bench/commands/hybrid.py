"""`ember bench hybrid`: a random-weight model of Qwen3.5-0.8B's shape, as a user gets it from llama.cpp's tools
(bf16 by its converter, Q8_0 and Q4_K_M by its quantizer), run by ember and by llama.cpp on the same file.

The model is written once into a cache folder: an HF folder by transformers (Qwen3_5ForCausalLM,
bf16, random weights), then its GGUF by llama.cpp's own converter (bf16; ember.bench.peers.llamacpp_convert)
and from that file, by llama.cpp's own quantizer (llama_model_quantize, through llama-cpp-python), the
Q8_0 and Q4_K_M files, each beside the folder and reused by later runs. llama.cpp picks each tensor's
type itself (Q4_K_M writes some Q6_K, the conv, ssm_a, ssm_dt and norms stay F32). The tokenizer is
Qwen's (151,936 ids, from llama.cpp's own vocab file: the converter only takes tokenizers it knows); the
config's vocab_size stays Qwen3.5's 248,320 (the converter pads the GGUF vocabulary), so the embedding
and the tied head have Qwen3.5-0.8B's size. Prompts are token ids, so the text the random model writes
does not matter.

For each file of --files, one after another: ember (LLM(model=file), the command's engine flags, no
speculation) and llama.cpp (the same file, same threads, flash attention), each in a worker process of
its own, take alternating rounds (ember.bench.lib.rounds): batch-1 decode, TTFT at 2,000 tokens, offline
throughput of 16 sequences (llama.cpp in its best batched configuration: with --llamacpp-batch best the
warmup round runs it parallel and sequential on the same prompts and the faster is measured), peak RSS,
the achieved share of the read bandwidth measured in the same rounds, and a per-op split of one ember
decode step (ember.bench.lib.op_split). transformers on the HF folder (the bf16 file's values) joins the
bf16 file's rounds with --peer llamacpp,hf. Issue 40's bars are judged per file, in one table.

--files moe_bf16 (named, not a default) adds a sparse MoE hybrid: a random small Qwen3.5-MoE model
(QWEN35_MOE_SMALL, its own folder, --moe-model-dir) in bf16 by the same converter, run the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from ember.bench.commands import compare
from ember.bench.lib import op_split
from ember.bench.lib.args import add_common_args, add_workload_args, command_line, int_list, switches
from ember.bench.lib.bar import Bar
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import cell, describe, fmt, ratio_cell, row
from ember.bench.lib.prompts import prompt_maker_of
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
from ember.bench.lib.timing import DECODE_PROMPT_LEN
from ember.bench.peers import PEERS
from ember.bench.sides.ember import NO_SPECULATION, ember_factory, ember_knobs
from ember.bench.sides.worker import start_side

logger = logging.getLogger("ember.bench")

NAME = KIND = "hybrid"
HELP = (
    "a random-weight Qwen3.5-0.8B-shaped hybrid (Gated DeltaNet) model in bf16, Q8_0 and Q4_K_M (llama.cpp's "
    "converter and quantizer): ember vs llama.cpp on each file, a per-op split of ember's decode step"
)
PARSER = compare.PARSER
TITLE = (
    "hybrid: a random Qwen3.5-0.8B-shaped model, ember and llama.cpp on the same GGUF files (llama.cpp's "
    "converter and quantizer), same threads"
)
EMBER, LLAMA, HF = "ember", "llama.cpp", "transformers"
# --files name -> llama.cpp's name of the type (LLAMA_FTYPE_MOSTLY_<name>), as the results show it; moe_bf16
# is another model's file (QWEN35_MOE_SMALL, --moe-model-dir), bf16 by the converter, run only when named
FILES = {"bf16": "BF16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M", "moe_bf16": "MoE BF16"}
DEFAULT_FILES = ["bf16", "q8_0", "q4_k_m"]
# issue 40's bars: batch-1 decode against llama.cpp per file (the MoE file judged as the dense bf16 one);
# TTFT, throughput and peak RSS ratios; the share of GDN core + conv in a decode step (%)
DECODE_BAR = {"bf16": 0.9, "q8_0": 1.0, "q4_k_m": 1.2, "moe_bf16": 0.9}
TTFT_BAR, THROUGHPUT_BAR, RSS_BAR, GDN_CONV_BAR = 0.5, 2.0, 1.2, 10.0
BATCH_MODES = ("parallel", "sequential")
SPLIT_SEED = 10**6  # the per-op split's prompt: a seed no round's prompts use

# Qwen3.5-0.8B's text model as published: 24 layers (every 4th full attention: 6 KV layers), hidden
# 1024, 8 query / 2 KV heads of 256 with a quarter rotated, tied embeddings, vocab 248,320; the linear
# heads (16 key / 16 value of 128) and the MLP (3,584) are the family's, not read off that checkpoint.
QWEN35_08B = dict(
    vocab_size=248320,
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    intermediate_size=3584,
    full_attention_interval=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [11, 11, 10],
        "mrope_interleaved": True,
    },
)


# A small Qwen3.5-MoE: QWEN35_08B's layers with a sparse MoE block in each (Qwen3.5-MoE's layout: routed
# experts plus a shared expert under a sigmoid gate), 32 experts of 256 routed top-4 and a shared one of
# 512; about 2.3 GB in bf16, 1.2 GB of it routed experts, of which a token reads an eighth.
QWEN35_MOE_SMALL = {k: v for k, v in QWEN35_08B.items() if k != "intermediate_size"} | dict(
    num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256, shared_expert_intermediate_size=512
)
# transformers' family -> its config class (the text model's, for the Qwen3.5 families)
CONFIGS = {"Qwen3_5": "Qwen3_5TextConfig", "Qwen3_5Moe": "Qwen3_5MoeTextConfig", "Qwen3Next": "Qwen3NextConfig"}


def cache_root() -> str:
    return os.environ.get("EMBER_BENCH_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ember", "bench"))


def build_folder(
    path: str, seed: int = 0, shape: dict = QWEN35_08B, arch: str = "Qwen3_5", tokenizer=None, device=None
) -> str:
    """The random HF folder (once): weights N(0, 0.02), norms at their identity, decays spread.
    arch: transformers' family, a CONFIGS key (Qwen3_5: Qwen3_5TextConfig / Qwen3_5ForCausalLM);
    tokenizer(folder) writes the tokenizer files (default: Qwen's, from llama.cpp's vocab file);
    device: where the weights are drawn (scripts/gpu_check.py draws them on the GPU)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    import transformers

    from ember.bench.peers.llamacpp_convert import write_qwen_tokenizer

    torch.manual_seed(seed)
    config_cls = getattr(transformers, CONFIGS[arch])
    config = config_cls(**shape, dtype="bfloat16")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of a big model
    try:
        with torch.device(device or "cpu"):
            model = getattr(transformers, f"{arch}ForCausalLM")(config).to(torch.bfloat16).eval()
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-2.0, 1.5)
            elif name.endswith("dt_bias") or name.endswith("linear_attn.norm.weight"):
                p.fill_(1.0)
            elif "norm" in name:
                p.zero_()  # zero-centred norms: weight 0 is the identity
            else:
                p.normal_(0.0, 0.02)
    partial = path + ".partial"
    model.save_pretrained(partial)
    (tokenizer or write_qwen_tokenizer)(partial)
    os.replace(partial, path)
    return path


def build_gguf(folder: str) -> str:
    from ember.bench.peers.llamacpp_convert import convert

    out = folder.rstrip("/") + ".bf16.gguf"
    if not os.path.exists(out):
        convert(folder, out + ".partial", "bf16", ("--no-mtp",))
        os.replace(out + ".partial", out)
    return out


def build_file(folder: str, kind: str, threads: int = 0) -> str:
    """The GGUF file of type `kind` (a FILES key) of the folder's model (once): bf16 by llama.cpp's converter,
    the others by its quantizer from that bf16 file."""
    if kind in ("bf16", "moe_bf16"):
        return build_gguf(folder)
    from ember.bench.peers.llamacpp_convert import quantize

    out = f"{folder.rstrip('/')}.{kind}.gguf"
    if not os.path.exists(out):
        quantize(build_gguf(folder), out + ".partial", FILES[kind], threads)
        os.replace(out + ".partial", out)
    return out


def file_list(s: str) -> list[str]:
    names = list(dict.fromkeys(x.strip().lower() for x in s.split(",") if x.strip()))
    bad = [n for n in names if n not in FILES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"want a comma list of {', '.join(FILES)} (got {s!r})")
    return names


# -- one file's rounds ----------------------------------------------------------------------------


def best_throughput_task(maker, args, llama, chosen: dict, skip=frozenset()):
    """The offline-throughput task; llama.cpp (the side `llama`) in its best batched configuration. With
    --llamacpp-batch best, its first call (the warmup round) runs both modes on the same prompts and every
    later call the faster; chosen gets {"mode", "warmup_out_tok_s"}. A pinned mode is just used. skip: sides
    that do not take it."""
    lo, hi = args.input_len_range
    task = throughput_task(maker, args.num_prompts, lo, hi, args.output_len, skip)
    key, plain = task.figures[0].key, task.measure
    if args.llamacpp_batch != "best":
        chosen["mode"] = args.llamacpp_batch

    def rate(side, prompts, mode: str) -> float:
        seconds, generated = side.batch(prompts, args.output_len, mode)
        assert generated == len(prompts) * args.output_len, f"{generated} tokens, wanted {len(prompts)} x n"
        return generated / seconds

    def measure_one(side, prompts):
        if side is not llama:
            return plain(side, prompts)
        if "mode" not in chosen:
            rates = {m: rate(side, prompts, m) for m in BATCH_MODES}
            chosen.update(mode=max(rates, key=rates.get), warmup_out_tok_s=rates)
            logger.info("bench hybrid: llama.cpp's throughput in the warmup round: %s", rates)
            return {key: rates[chosen["mode"]]}
        return {key: rate(side, prompts, chosen["mode"])}

    return dataclasses.replace(task, measure=measure_one)


def start_file_sides(sides: dict, args, kind: str, path: str, folder: str, knobs: dict, threads: int) -> None:
    """ember and llama.cpp on the file, and transformers on the HF folder beside the bf16 file (--peer hf);
    into `sides` (the caller closes what started)."""
    from ember.platform import resolve_dtype_name

    lo, hi = args.input_len_range
    sides[EMBER] = start_side(ember_factory(), {**knobs, "model": path}, threads, args.in_process)
    if "llamacpp" in args.peer:
        llama = {
            "gguf_path": path,
            "threads": threads,
            "n_ctx": max(4096, max(args.prompt_lens) + hi + args.output_len),
            "batch_mode": "parallel" if args.llamacpp_batch == "best" else args.llamacpp_batch,
        }
        sides[LLAMA] = start_side(PEERS["llamacpp"], llama, threads, args.in_process)
    if "hf" in args.peer and kind == "bf16":
        hf = {"model_path": folder, "dtype": resolve_dtype_name("auto", "cpu")}
        sides[HF] = start_side(PEERS["hf"], hf, threads, args.in_process)


def achieved(bandwidth: list[float], figure: dict, side: str, weight_bytes: int | None) -> dict | None:
    """A side's decode bytes/s (weight_bytes x tok/s) and its share of the bandwidth probe, round by round."""
    runs = figure["values"].get(side, {}).get("runs", [])
    if not bandwidth or not weight_bytes or not runs:
        return None
    gbps = [weight_bytes * t / 1e9 for t in runs]
    percent = [100 * a / b for a, b in zip(gbps, bandwidth)]
    return {
        "weight_bytes": weight_bytes,
        "gbps": {"runs": gbps, **spread(gbps)},
        "percent": {"runs": percent, **spread(percent)},
    }


def workload_cache_gib(args, path: str, knobs: dict) -> float:
    """ember's cache budget (--kv-cache-memory) when the user sets none: what the bench's largest phase
    holds at once -- the throughput batch's prompts and outputs (or the TTFT prompt, if longer) in KV
    blocks, each sequence's last block partly filled, plus the state pool the engine keeps with these
    knobs (a live slot per sequence, and the prefix-cache snapshots asked for). The pools are touched at start,
    so they are in peak RSS; llama.cpp's batch context is sized the same way (its prompts and outputs
    + 256 tokens), and the KV-per-element-byte rule of the dense benches would give a hybrid's few
    attention layers a pool many times what any phase fills. The three files share one shape."""
    from ember.config import EngineConfig
    from ember.engine.planner import plan

    config = EngineConfig(**{**knobs, "model": path, "kv_cache_memory": None, "device": "cpu"})
    p = plan(config, memory_gib=1024.0)
    lo, hi = args.input_len_range
    seqs = max(1, args.num_prompts)
    tokens = max(seqs * (hi + args.output_len), max(args.prompt_lens) + 1, DECODE_PROMPT_LEN + args.decode_tokens)
    tokens += seqs * config.block_size
    return (tokens * p.kv_bytes_per_token + p.state_slots * p.state_bytes_per_seq) / (1 << 30)


def run_file(
    args,
    kind: str,
    path: str,
    folder: str,
    knobs: dict,
    threads: int,
    type_name=None,
    after=None,
    bench="hybrid",
    decode_sides: dict | None = None,
    token_bytes: int | None = None,
) -> dict:
    """One file's rounds (every side, every figure), peak RSS and ember's per-op split. type_name: the file's
    name in the results (default FILES[kind]); after(sides, maker): more figures of the file, taken after the
    rounds while its sides are up (`ember bench flash`); bench: the command's name in the progress bar;
    decode_sides: {name: engine knobs over `knobs`}, more ember sides on the file that take the batch-1 decode
    rounds only (`ember bench flash`'s ember+MTP); token_bytes: what a decode token reads, for the achieved-bandwidth
    row where that is not each side's whole weights (a MoE file: flash.token_bytes)."""
    sides, chosen = {}, {}
    type_name = type_name or FILES[kind]
    extra = frozenset(decode_sides or ())
    try:
        start_file_sides(sides, args, kind, path, folder, knobs, threads)
        for name, more in (decode_sides or {}).items():
            sides[name] = start_side(ember_factory(), {**knobs, "model": path, **more}, threads, args.in_process)
        maker = prompt_maker_of(sides[EMBER], args.prompt_seed)
        tasks = [
            decode_task(maker, args.decode_tokens),
            *(ttft_task(maker, n, extra) for n in args.prompt_lens),
            best_throughput_task(maker, args, sides.get(LLAMA), chosen, extra),
        ]
        results, bandwidth = measure(
            sides,
            tasks,
            runs=args.runs,
            quiet_wait_s=args.quiet_wait,
            bandwidth_mib=args.bandwidth_mib,
            desc=f"bench {bench} {type_name}",
        )
        figures = summarize_figures([f for t in tasks for f in t.figures], results)
        rss = {n: s.peak_rss_bytes() / (1 << 20) for n, s in sides.items()}  # before the profiler's memory
        split = None
        if args.split_steps:
            prompt = maker.make(1, DECODE_PROMPT_LEN, SPLIT_SEED)[0]
            split = sides[EMBER].call("op_split", prompt, args.split_steps)
        weights = {EMBER: sides[EMBER].weight_bytes, LLAMA: os.path.getsize(path)}
        if token_bytes is not None:
            weights = dict.fromkeys(weights, token_bytes)
        more = after(sides, maker) if after is not None else {}
        return {
            **more,
            "type": type_name,
            "path": path,
            "file_bytes": os.path.getsize(path),
            "sides": {n: s.description for n, s in sides.items()},
            "figures": figures,
            "peak_rss_mib": rss,
            "rss_shared_process": any(s.shared_process for s in sides.values()),
            "bandwidth": {
                "gbps": {"runs": bandwidth, **spread(bandwidth)},
                **{n: achieved(bandwidth, figures[0], n, b) for n, b in weights.items() if n in sides},
            },
            "llamacpp_batch": chosen if LLAMA in sides else None,
            "op_split": split,
        }
    finally:
        for s in sides.values():
            s.close()


# -- the tables and bars --------------------------------------------------------------------------


def _figure_name(f: dict, d: dict) -> str:
    mode = (d.get("llamacpp_batch") or {}).get("mode")
    return f"{f['name']}{f'; llama.cpp {mode}' if f['key'] == 'throughput' and mode else ''} ({f['unit']})"


def file_rows(kind: str, d: dict, peers: list[str]) -> list[str]:
    """One file's rows: every figure, peak RSS, the achieved share of the read bandwidth."""
    name, lines = d["type"], []
    for f in d["figures"]:
        cells = [name, _figure_name(f, d), cell(f["values"].get(EMBER)), *[cell(f["values"].get(p)) for p in peers]]
        lines.append(row(cells + [ratio_cell(paired_ratios(f, EMBER, p)) for p in peers]))
    rss = d["peak_rss_mib"]
    cells = [name, "peak RSS (MiB)", fmt(rss[EMBER]), *[fmt(rss.get(p)) for p in peers]]
    lines.append(row(cells + [f"{rss[EMBER] / rss[p]:.2f}x" if rss.get(p) else "-" for p in peers]))
    bw = d["bandwidth"]
    pct = {n: (bw.get(n) or {}).get("percent") for n in [EMBER, *peers]}
    cells = [name, "achieved read bandwidth (% of measured)", *[cell(pct[n], "%") for n in [EMBER, *peers]]]
    ratios = [f"{pct[EMBER]['median'] / pct[p]['median']:.2f}x" if pct[EMBER] and pct.get(p) else "-" for p in peers]
    return lines + [row(cells + ratios)]


def bandwidth_lines(files: dict) -> list[str]:
    """Per file: the bandwidth probe, what each side's decode step reads, and what it achieves."""
    lines = []
    for kind, d in files.items():
        bw = d["bandwidth"]
        if not bw["gbps"].get("runs"):
            continue
        sides = [
            f"{n} reads {a['weight_bytes'] / 1e6:.1f} MB a token ({what}): {cell(a['gbps'])} GB/s = "
            f"{cell(a['percent'], '%')}"
            for n, what in ((EMBER, "weights as loaded"), (LLAMA, "the GGUF file's size"))
            if (a := bw.get(n))
        ]
        lines.append(f"- {d['type']}: read bandwidth {cell(bw['gbps'])} GB/s; " + "; ".join(sides))
    return lines


def split_table(files: dict) -> list[str]:
    """ember's decode step by kind of work (ember.bench.lib.op_split: the model's own categories), per file."""
    first = next((d["op_split"] for d in files.values() if d["op_split"]), None)
    categories = list(first["ms"]) if first else list(op_split.CATEGORIES)
    columns = ["file", "executor", "step (ms)", "profiled step (ms)", *categories]
    lines, notes = [row(columns), "|---|---|" + "---:|" * (len(columns) - 2)], []
    for kind, d in files.items():
        s = d["op_split"]
        if s is None:
            continue
        if not s["labelled"]:
            notes.append(
                f"{d['type']}: the step ran as a compiled graph ({s['executor']}): only its kernel ops split out"
            )
        cells = [
            f"{s['ms'][c]:.2f} ({s['percent'][c]:.0f}%)" if s["percent"][c] is not None else "-" for c in categories
        ]
        lines.append(row([d["type"], s["executor"], f"{s['step_ms']:.2f}", f"{s['profiled_step_ms']:.2f}", *cells]))
    return lines + ([""] + [f"- {n}" for n in notes] if notes else [])


def table(files: dict, peers: list[str]) -> list[str]:
    columns = ["file", "metric", EMBER, *peers, *[f"{EMBER} / {p}" for p in peers]]
    lines = [row(columns), "|---|---|" + "---:|" * (len(columns) - 2)]
    for kind, d in files.items():
        lines += file_rows(kind, d, peers)
    lines += [
        "",
        "Memory (batch-1 decode bytes a token x tok/s, round by round, against the probe of the same rounds):",
    ]
    lines += bandwidth_lines(files)
    if any(d["op_split"] for d in files.values()):
        lines += ["", "ember's batch-1 decode step, by kind of work (ms per step, % of the profiled step):", ""]
        lines += split_table(files)
    return lines


def gdn_conv_bar(name: str, kind: str, s: dict | None) -> Bar:
    pct = None
    missing = "no per-op split (--split-steps 0)"
    if s is not None:
        if not s["ms"][op_split.GDN]:
            missing = "the split saw no ember_cpu::gated_delta_net (the torch path ran)"
        else:
            pct = s["percent"][op_split.GDN] + s["percent"][op_split.CONV]
    return Bar(
        f"{name}: GDN core + conv <= {GDN_CONV_BAR:.0f}% of a decode step",
        "<=",
        GDN_CONV_BAR,
        pct,
        shown=f"{pct:.1f}%" if pct is not None else None,
        missing=missing,
        on={"file": kind, "figure": "op_split"},
    )


def file_bars(kind: str, d: dict, ttft_len: int, n: int) -> list[Bar]:
    """Issue 40's bars on one file."""
    name, figures = FILES[kind], d["figures"]
    mode = (d.get("llamacpp_batch") or {}).get("mode", "-")
    specs = [
        (f"{name}: batch-1 decode >= {DECODE_BAR[kind]}x llama.cpp", "decode", ">=", DECODE_BAR[kind]),
        (f"{name}: TTFT at {ttft_len} tokens <= {TTFT_BAR}x llama.cpp's", ttft_key(ttft_len), "<=", TTFT_BAR),
        (
            f"{name}: {n}-sequence throughput >= {THROUGHPUT_BAR:.0f}x llama.cpp's best batched ({mode})",
            "throughput",
            ">=",
            THROUGHPUT_BAR,
        ),
    ]
    bars = [ratio_bar(text, figures, key, EMBER, LLAMA, op, t) for text, key, op, t in specs]
    rss = d["peak_rss_mib"]
    ratio = rss[EMBER] / rss[LLAMA] if rss.get(LLAMA) and not d["rss_shared_process"] else None
    bars.append(
        Bar(
            f"{name}: peak RSS <= {RSS_BAR}x llama.cpp's",
            "<=",
            RSS_BAR,
            ratio,
            missing="all sides in one process (--in-process)" if d["rss_shared_process"] else "no llama.cpp side",
            on={"figure": "peak_rss", "side": EMBER, "peer": LLAMA},
        )
    )
    bars.append(gdn_conv_bar(name, kind, d["op_split"]))
    for b in bars:
        b.on = {"file": kind, **b.on}
    return bars


# -- the command ----------------------------------------------------------------------------------


def notes(args, knobs: dict, shared: bool, user_cache: bool = True, user_snapshots: bool = True) -> list[str]:
    """How each figure was measured, for the report."""
    from ember.bench.lib import membw
    from ember.bench.peers.hf import BATCH_METHOD as HF_BATCH
    from ember.bench.peers.llamacpp import BATCH_METHODS as LLAMA_BATCH

    best = (
        "llama.cpp's best batched configuration: in the warmup round it ran the prompts both parallel and "
        "sequential and the faster mode (named in the row) is measured in every round; "
        if args.llamacpp_batch == "best"
        else f"llama.cpp pinned to --llamacpp-batch {args.llamacpp_batch}; "
    )
    out = [
        "files: bf16 by llama.cpp's convert_hf_to_gguf.py (--outtype bf16) from the HF folder, Q8_0 and Q4_K_M by "
        "llama.cpp's llama_model_quantize from that bf16 file (its own per-tensor choices); each built once and "
        "reused; the files one after another, each with sides of its own (worker processes started for it)",
        f"{args.runs} measured rounds after 1 warmup round per file; cells are median [min-max]; ember / peer "
        "ratios are taken round by round, then summarized; every side sees the same prompts, new each round "
        "(seeded random ordinary tokens)",
        f"decode: greedy, {args.decode_tokens} tokens after a {DECODE_PROMPT_LEN}-token random prompt, EOS ignored; "
        "mean = (N - 1) / (last token time - first token time), which the bars use; steady = 1 / median gap",
        "TTFT: ember add_request() to its first token through the step loop; llama.cpp generate() to its first token",
        f"throughput: ember one LLM.generate() over all prompts (max_num_seqs {knobs['max_num_seqs']}, cache "
        f"budget {knobs['kv_cache_memory']:.3f} GiB"
        + (": the largest phase's KV blocks and the state pool, workload_cache_gib" if not user_cache else "")
        + f"; {knobs['max_state_snapshots']} prefix-cache state snapshots"
        + (
            " (llama.cpp keeps none and no prompt repeats; ember's default is 2 x max_num_seqs, "
            "18.6 MiB each for this shape: --max-state-snapshots N measures them)"
            if not user_snapshots
            else ""
        )
        + "); "
        + best
        + "; ".join(LLAMA_BATCH.values())
        + ("; " + HF_BATCH if "hf" in args.peer else ""),
        "peak RSS: all sides ran in this one process (--in-process): not attributable, its bar is not judged"
        if shared
        else "peak RSS: each side's worker process (python -m ember.bench.sides.worker), its resource.getrusage "
        "high-water mark, read after the rounds (the interpreter, libraries and ember's preallocated pools "
        "included)",
        op_split.METHOD.format(steps=args.split_steps, prompt=DECODE_PROMPT_LEN),
    ]
    if "moe_bf16" in args.files:
        shape = ", ".join(f"{k} {QWEN35_MOE_SMALL[k]}" for k in QWEN35_MOE_SMALL if k not in QWEN35_08B)
        out.append(f"MoE BF16: a random Qwen3.5-MoE model, QWEN35_08B's layers with a sparse MoE block ({shape})")
    if "hf" in args.peer:
        out.append("transformers: on the HF folder (the bf16 file's values), measured beside the bf16 file only")
    if args.bandwidth_mib:
        out.append(
            membw.METHOD.format(mib=args.bandwidth_mib) + "; achieved = bytes a decode step reads x decode tok/s"
        )
    return out


def command(args) -> str:
    flags = [
        "runs",
        "peer",
        "files",
        "model_dir",
        "moe_model_dir",
        "output",
        "prompt_seed",
        "quiet_wait",
        "decode_tokens",
    ]
    flags += ["prompt_lens", "num_prompts", "input_len_range", "output_len", "bandwidth_mib", "llamacpp_batch"]
    return command_line(args, flags + ["split_steps"]) + switches(args)


def main(args) -> None:
    from ember.errors import ConfigError

    if args.decode_tokens < 2:
        raise ConfigError(f"--decode-tokens must be >= 2 (got {args.decode_tokens})")
    if getattr(args, "model", None) is not None or getattr(args, "model_pos", None) is not None:
        raise ConfigError("ember bench hybrid runs the files it builds (--model-dir, --files), not --model")
    compare.check_peers_installed(args.peer)
    line = command(args)
    folders = {kind: model_folder(args, kind) for kind in args.files}
    paths = {kind: build_file(folders[kind], kind) for kind in args.files}
    logger.info("bench hybrid: %s", ", ".join(paths.values()))
    args.model = paths[args.files[0]]  # the engine flags' model: each file's is set in its sides
    user_cache = getattr(args, "kv_cache_memory", None) is not None
    knobs, threads = ember_knobs(args, args.num_prompts)
    knobs.update(NO_SPECULATION)
    user_snapshots = knobs.get("max_state_snapshots") is not None
    if not user_snapshots:
        # like for like: llama-cpp-python keeps one state per sequence and no checkpoints, and every
        # round's prompts are new, so no snapshot could be hit; each would only add its 18.6 MiB
        knobs["max_state_snapshots"] = 0
    if not user_cache:
        knobs["kv_cache_memory"] = workload_cache_gib(args, paths[args.files[0]], knobs)
    load = load_average()
    files = {kind: run_file(args, kind, path, folders[kind], knobs, threads) for kind, path in paths.items()}
    peers = list(dict.fromkeys(n for d in files.values() for n in d["sides"] if n != EMBER))
    shared = any(d["rss_shared_process"] for d in files.values())
    judged = [b for kind, d in files.items() for b in file_bars(kind, d, max(args.prompt_lens), args.num_prompts)]
    about = [f"{FILES[k]} {n}: {describe(s)}" for k, d in files.items() for n, s in d["sides"].items()]
    data = {"threads": threads, "runs": args.runs, "model_folder": folders[args.files[0]], "files": files}
    Result(
        KIND,
        TITLE,
        line,
        load,
        about,
        notes(args, knobs, shared, user_cache, user_snapshots),
        table(files, peers),
        data,
        judged,
    ).publish(args.output)


def model_folder(args, kind: str) -> str:
    """The random HF folder a file kind is built from (built once): the dense Qwen3.5-0.8B shape, or for
    moe_bf16 the small Qwen3.5-MoE one."""
    if kind == "moe_bf16":
        path = args.moe_model_dir or os.path.join(cache_root(), "qwen3.5-moe-small-shape-random")
        return build_folder(path, shape=QWEN35_MOE_SMALL, arch="Qwen3_5Moe")
    return build_folder(args.model_dir or os.path.join(cache_root(), "qwen3.5-0.8b-shape-random"))


def add_cli_args(p) -> None:
    add_common_args(
        p,
        {
            "type": compare.peer_list,
            "default": ["llamacpp"],
            "metavar": "PEER,PEER|none",
            "help": "llamacpp = llama.cpp through llama-cpp-python on each file; hf = transformers on the HF "
            "folder, beside the bf16 file (slow); none = ember only",
        },
    )
    p.add_argument(
        "--files",
        type=file_list,
        default=DEFAULT_FILES,
        metavar="TYPE,TYPE",
        help=f"which GGUF files (types) to run, of {', '.join(FILES)}: bf16 by llama.cpp's converter, the "
        "others by its quantizer from it; each built once beside the model folder; moe_bf16 (not run unless "
        "named): a small Qwen3.5-MoE model's bf16 file, from --moe-model-dir",
    )
    p.add_argument("--model-dir", default=None, help="where the random HF folder is (built there if missing)")
    p.add_argument(
        "--moe-model-dir",
        default=None,
        help="where the random small Qwen3.5-MoE HF folder of --files moe_bf16 is (built there if missing)",
    )
    p.add_argument(
        "--prompt-lens", type=int_list, default=[2000], metavar="N,N,...", help="TTFT prompt lengths (bar: longest)"
    )
    p.add_argument(
        "--llamacpp-batch",
        choices=("best", *BATCH_MODES),
        default="best",
        help="llama.cpp's offline throughput: best = run both in the warmup round and measure the faster; "
        "parallel = all prompts as sequences of one llama_decode batch, sequential = one after another",
    )
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the memory-bandwidth probe (0 = skip it)")
    p.add_argument(
        "--split-steps", type=int, default=8, help="decode steps the per-op split of ember profiles (0 = no split)"
    )
    add_workload_args(p, prompt_help="for quick checks")
    p.set_defaults(output="benchmarks/hybrid.md", num_prompts=16, decode_tokens=64, output_len=128, max_model_len=4096)
