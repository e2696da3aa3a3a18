"""`ember bench quant`: what each weight / KV format costs and buys on the default model.

One run builds, one after another, an engine for each format and measures:
- resident weight bytes (parameters + buffers, each storage once; plus any int8 decode copy),
  against the GGUF file's own tensor bytes;
- batch-1 greedy decode tok/s (steady = 1 / median gap between tokens; median of --runs runs);
- perplexity on held-out pydoc text (`pydoc_split("eval")`, disjoint from the calibration
  half `ember quantize --calib pydoc` uses), windows of --window tokens in prefill chunks of
  --chunk, through the engine's own forward (so FP8 KV is read back from the cache).

The AWQ and round-to-nearest folders are made by `ember quantize` from the dequantized
(bf16-run) weights of the same GGUF, first, unless they already exist under --work-dir.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import statistics
import time
from pathlib import Path

from ember.bench.lib.args import command_line
from ember.bench.lib.bar import Bar
from ember.bench.lib.machine import load_average
from ember.bench.lib.result import Result

logger = logging.getLogger("ember.bench")

NAME = "quant"
HELP = "memory, decode speed and perplexity of each weight / KV format"
DEFAULT_OUTPUT = "benchmarks/quant.md"
TITLE = "Quantization: memory, decode speed, perplexity (default model)"
HEADER = (
    "# ember quantization benchmarks\n\nWritten by `ember bench quant`; raw rows in the JSON file next to this one.\n"
)
DECODE_PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclasses.dataclass
class Variant:
    kind: str  # dense | int8 | gguf | awq | rtn | fp8
    label: str
    engine_kwargs: dict
    model: str | None = None  # None = the default GGUF
    ppl: bool = True
    group_size: int | None = None


@dataclasses.dataclass
class Row:
    kind: str
    label: str
    group_size: int | None
    weight_bytes: int
    decode_tok_s: list[float]
    perplexity: float | None
    scored_tokens: int


def variants(quantized: dict[int, dict[str, str]], dtype: str) -> list[Variant]:
    """quantized: group size -> {"awq": folder, "rtn": folder}."""
    dense = {"quantization": "none", "int8_decode": False}
    out = [
        Variant("dense", f"{dtype} dense (GGUF dequantized)", dense),
        Variant("int8", f"{dtype} dense + int8 decode copy", {"quantization": "none", "int8_decode": True}, ppl=False),
        Variant("gguf", "GGUF Q4_1 packed, as shipped", {"quantization": "gguf"}),
    ]
    for g, dirs in quantized.items():
        out += [
            Variant(
                "awq",
                f"AWQ int4 g{g} (ember quantize --method awq)",
                {"quantization": "awq"},
                dirs["awq"],
                group_size=g,
            ),
            Variant(
                "rtn",
                f"RTN int4 g{g} (ember quantize --method rtn)",
                {"quantization": "awq"},
                dirs["rtn"],
                group_size=g,
            ),
        ]
    out.append(Variant("fp8", f"{dtype} dense + FP8 e4m3 KV cache", dense | {"kv_cache_dtype": "fp8"}))
    return out


def ensure_quantized(source: str, out: str, method: str, group_size: int, num_samples: int, seq_len: int) -> float:
    """Run `ember quantize` into `out` unless it is already there; returns the seconds it took (0 if cached)."""
    if os.path.exists(os.path.join(out, "config.json")):
        logger.info("bench quant: reusing %s", out)
        return 0.0
    from ember.train.quantize import quantize

    t0 = time.perf_counter()
    quantize(
        source,
        out,
        method=method,
        bits=4,
        group_size=group_size,
        zero_point=True,
        calib="pydoc",
        num_samples=num_samples,
        seq_len=seq_len,
    )
    return time.perf_counter() - t0


def measure(v: Variant, eval_ids: list[int] | None, args) -> Row:
    from ember.bench.lib.timing import decode_rates, ember_decode
    from ember.eval.perplexity import perplexity
    from ember.llm import LLM

    # enable_mtp=False: the weight formats are compared, not speculation (the default model's head is on by default)
    kwargs = (
        dict(
            model=v.model,
            dtype=args.dtype,
            kv_cache_memory=args.kv_cache_memory,
            max_model_len=max(args.window, 1024),
            enable_prefix_caching=False,
            enable_mtp=False,
        )
        | v.engine_kwargs
    )
    llm = LLM(**kwargs)
    llm.wait_for_compile()  # benchmarks measure the steady state: a background compile finishes first
    engine = llm.engine
    weight_bytes = engine.parts.loaded.weight_bytes + engine.parts.copies.int8_decode_bytes
    prompt = engine.parts.loaded.tokenizer.encode(DECODE_PROMPT)
    ember_decode(engine, "warmup", prompt, 8)
    rates = []
    for r in range(args.runs):
        _, steady = decode_rates(ember_decode(engine, f"decode-{r}", prompt, args.decode_tokens))
        rates.append(steady)
    ppl, scored = None, 0
    if v.ppl and eval_ids is not None:
        res = perplexity(engine, eval_ids, window=args.window, chunk=args.chunk)
        ppl, scored = res.perplexity, res.scored_tokens
    logger.info(
        "bench quant: %s: %.1f MB, decode %s tok/s, ppl %s",
        v.label,
        weight_bytes / 1e6,
        [round(x, 1) for x in rates],
        ppl,
    )
    del llm, engine
    gc.collect()
    return Row(v.kind, v.label, v.group_size, weight_bytes, rates, ppl, scored)


def table(rows: list[Row], gguf_tensor_bytes: int) -> list[str]:
    lines = [
        "| format | resident weights (MB) | × GGUF tensor bytes | batch-1 decode tok/s (median, min–max) "
        "| × dense | perplexity | Δ vs dense |",
        "|---|---|---|---|---|---|---|",
    ]
    base = rows[0]
    base_rate = statistics.median(base.decode_tok_s)
    for r in rows:
        rate = statistics.median(r.decode_tok_s)
        ppl = "-" if r.perplexity is None else f"{r.perplexity:.3f}"
        delta = (
            "-"
            if r.perplexity is None or base.perplexity is None
            else f"{100 * (r.perplexity / base.perplexity - 1):+.2f}%"
        )
        lines.append(
            f"| {r.label} | {r.weight_bytes / 1e6:.1f} | {r.weight_bytes / gguf_tensor_bytes:.2f} "
            f"| {rate:.1f} ({min(r.decode_tok_s):.1f}–{max(r.decode_tok_s):.1f}) | {rate / base_rate:.2f} "
            f"| {ppl} | {delta} |"
        )
    return lines


def bars(rows: list[Row], gguf_tensor_bytes: int) -> list[Bar]:
    """The bars of issue 4."""
    one = {r.kind: r for r in rows if r.kind in ("dense", "gguf", "fp8")}
    dense, packed, fp8 = one["dense"], one["gguf"], one["fp8"]
    ratio = packed.weight_bytes / gguf_tensor_bytes
    sp = statistics.median(packed.decode_tok_s) / statistics.median(dense.decode_tok_s)
    out = [
        Bar("packed GGUF resident weights <= 1.15x the GGUF tensor bytes", "<=", 1.15, ratio, shown=f"{ratio:.3f}x"),
        Bar("packed int4 batch-1 decode faster than bf16 dense", ">", 1.0, sp),
    ]
    for awq in (r for r in rows if r.kind == "awq"):
        g = awq.group_size
        rtn = next(r for r in rows if r.kind == "rtn" and r.group_size == g)
        d = awq.perplexity / dense.perplexity - 1
        out += [
            Bar(f"AWQ g{g} perplexity within 8% of dense", "<=", 0.08, d, shown=f"{100 * d:+.2f}%"),
            Bar(
                f"AWQ g{g} perplexity strictly better than round-to-nearest g{g}",
                "<",
                rtn.perplexity,
                awq.perplexity,
                shown=f"{awq.perplexity:.3f} vs {rtn.perplexity:.3f}",
            ),
        ]
    if fp8.perplexity and dense.perplexity:
        r = fp8.perplexity / dense.perplexity
        out.append(Bar("FP8 KV perplexity within 2% of bf16 KV", "within", 0.02, r, shown=f"{100 * (r - 1):+.2f}%"))
    return out


def report(
    rows: list[Row],
    *,
    command: str,
    gguf_path: str,
    gguf_tensor_bytes: int,
    notes: list[str],
    load_at_start: float | None,
) -> Result:
    about = [f"GGUF file tensor bytes: {gguf_tensor_bytes / 1e6:.1f} MB ({gguf_path})"]
    data = {
        "gguf_path": gguf_path,
        "gguf_tensor_bytes": gguf_tensor_bytes,
        "rows": [dataclasses.asdict(r) for r in rows],
    }
    return Result(
        NAME,
        TITLE,
        command,
        load_at_start,
        about,
        notes,
        table(rows, gguf_tensor_bytes),
        data,
        bars(rows, gguf_tensor_bytes),
    )


def main(args) -> None:
    import torch

    from ember.default_model import default_model_path
    from ember.loader.gguf import GGUFCheckpoint
    from ember.train.calibration import pydoc_split

    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    source = default_model_path()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    quantized = {g: {m: str(work / f"{m}-g{g}") for m in ("awq", "rtn")} for g in args.group_sizes}
    q_secs = {
        (g, m): ensure_quantized(source, d, m, g, args.calib_samples, args.calib_seq_len)
        for g, dirs in quantized.items()
        for m, d in dirs.items()
    }
    ckpt = GGUFCheckpoint(source)
    tok = ckpt.tokenizer()
    eval_text = "\n\n".join(pydoc_split("eval"))
    eval_ids = tok.encode(eval_text)[: args.eval_tokens]
    load = load_average()
    rows = [measure(v, eval_ids, args) for v in variants(quantized, args.dtype)]
    command = command_line(args, QUANT_FLAGS, engine=False)
    notes = [
        f"perplexity: {len(eval_ids)} tokens of held-out pydoc text (`pydoc_split('eval')`), windows of "
        f"{args.window} tokens prefilled in chunks of {args.chunk} (later chunks read earlier K/V from the cache)",
        f"decode: greedy, {args.decode_tokens} tokens after a {len(tok.encode(DECODE_PROMPT))}-token prompt, "
        f"steady rate (1 / median gap), {args.runs} runs; dtype {args.dtype}",
        f"AWQ / RTN: `ember quantize --group-size G --calib pydoc --num-samples {args.calib_samples} "
        f"--seq-len {args.calib_seq_len}` from the GGUF dequantized to fp32 (seconds taken here, 0 = reused: "
        + ", ".join(f"{m} g{g} {t:.0f}" for (g, m), t in q_secs.items())
        + "). No g128: the model's hidden "
        "size 576 is not a multiple of 128, so g128 cannot quantize q/k/v/gate/up (AutoAWQ and vLLM refuse "
        "it too); g32 is the group size the GGUF's own Q4_1 blocks use",
        "resident weights: parameters and buffers as held in memory (packed int4 codes + scales; the tied "
        "embedding / LM head once)",
    ]
    report(
        rows, command=command, gguf_path=source, gguf_tensor_bytes=ckpt.tensor_bytes, notes=notes, load_at_start=load
    ).publish(args.output, header=HEADER, json_file=Path(args.output).with_suffix(".json"))


QUANT_FLAGS = [
    "dtype",
    "runs",
    "decode_tokens",
    "eval_tokens",
    "window",
    "chunk",
    "group_sizes",
    "calib_samples",
    "calib_seq_len",
    "work_dir",
    "output",
    "kv_cache_memory",
]


def add_cli_args(p) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--eval-tokens", type=int, default=16384, help="held-out pydoc tokens scored for perplexity")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument(
        "--group-sizes",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[64, 32],
        help="AWQ / RTN group sizes to quantize and compare (comma-separated)",
    )
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--work-dir", default=".cache/bench-quant", help="where the quantized folders are written / reused")
    p.add_argument("--kv-cache-memory", type=float, default=0.25)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--output", default=DEFAULT_OUTPUT)
