"""`ember bench tp`: tensor parallelism TP=1 vs TP=N on this machine -- decode and prefill speed,
and how much of a step is communication.

The model: a random-weight Qwen3 of a real shape (default Qwen3-0.6B: 16 heads, 8 kv heads, so
it splits over 2 ranks; the default SmolLM2's 9 heads do not) written to a temporary folder, or
any model folder given. Each size gets its own engine; on CPU the cores are divided among the
ranks (torch threads = cores / N each), so TP=N on one machine shows the cost of the
communication, not a speedup (the issue says as much: two processes share the same two cores).

Per step of a batch-1 decode: wall time, rank 0's time in all-reduce / all-gather (the model's
collectives), and the broadcast of the step's inputs to the workers; their medians and share
of the step. Prefill: one prompt of --prompt-len tokens, tokens / TTFT.
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from pathlib import Path

from ember.bench.lib.args import command_line, int_list, positive_int
from ember.bench.lib.machine import load_average
from ember.bench.lib.result import Result
from ember.sampling import SamplingParams

logger = logging.getLogger("ember.bench")

NAME = KIND = "tp"
HELP = "tensor parallelism: TP=1 vs TP=N decode / prefill and communication share"
HEADER = "# ember tensor-parallel benchmarks\n\nWritten by `ember bench tp`.\n"

SHAPES = {  # real layer shapes, fewer layers where a whole model would crawl on 2 cores
    "qwen3-0.6b": dict(
        label="Qwen3-0.6B shape (28 layers), random bf16 weights",
        hidden=1024,
        inter=3072,
        layers=28,
        heads=16,
        kv_heads=8,
        head_dim=128,
        tie=True,
    ),
    "tiny": dict(
        label="tiny Qwen3 (2 layers)",
        vocab=512,
        hidden=64,
        inter=128,
        layers=2,
        heads=4,
        kv_heads=2,
        head_dim=16,
        tie=True,
    ),
}


def decode_steps(llm, prompt: list[int], n: int) -> list[dict]:
    """Greedy batch-1 decode of n tokens through engine.step(); per decode step: wall, comm, broadcast."""
    eng = llm.engine
    eng.add_request(
        "tp-decode", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    )
    eng.step()  # the prefill
    steps = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        wall = time.perf_counter() - t0
        st = eng.stats()
        steps.append(
            {
                "wall": wall,
                "comm": st.get("tp_comm_seconds_last_step", 0.0),
                "broadcast": st.get("tp_broadcast_seconds_last_step", 0.0),
            }
        )
    return steps


def prefill_seconds(llm, prompt: list[int]) -> float:
    eng = llm.engine
    t0 = time.perf_counter()
    eng.add_request("tp-prefill", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1))
    while eng.has_unfinished_requests():
        eng.step()
    return time.perf_counter() - t0


def measure(path: str, tp: int, *, runs: int, decode_tokens: int, prompt_len: int, knobs: dict) -> dict:
    import torch

    from ember.llm import LLM

    llm = LLM(path, tensor_parallel_size=tp, enable_prefix_caching=False, **knobs)
    try:
        vocab = llm.engine.parts.loaded.model_config.vocab_size
        prompt = lambda seed, n: [(seed * 7919 + 31 * i) % (vocab - 10) + 5 for i in range(n)]  # noqa: E731
        decode_steps(llm, prompt(999, 16), 4)  # warmup
        rates, comm, bcast, share = [], [], [], []
        prefill = []
        for r in range(runs):
            steps = decode_steps(llm, prompt(r, 16), decode_tokens)
            walls = [s["wall"] for s in steps]
            rates.append(len(steps) / sum(walls))
            comm += [s["comm"] for s in steps]
            bcast += [s["broadcast"] for s in steps]
            share += [(s["comm"] + s["broadcast"]) / s["wall"] for s in steps]
            prefill.append(prompt_len / prefill_seconds(llm, prompt(1000 + r, prompt_len)))
        out = {
            "tp": tp,
            "decode_tok_s": rates,
            "prefill_tok_s": prefill,
            "comm_ms_median": 1000 * statistics.median(comm),
            "broadcast_ms_median": 1000 * statistics.median(bcast),
            "comm_share_median": statistics.median(share),
            "threads_per_rank": torch.get_num_threads(),
        }
        return out
    finally:
        llm.engine.shutdown()


def table(rows: list[dict]) -> list[str]:
    lines = [
        "| TP | threads per rank | decode tok/s | vs TP=1 | prefill tok/s | vs TP=1 | comm ms / step | "
        "broadcast ms / step | comm share of a decode step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base_decode, base_prefill = statistics.median(rows[0]["decode_tok_s"]), statistics.median(rows[0]["prefill_tok_s"])
    for r in rows:
        d, p = statistics.median(r["decode_tok_s"]), statistics.median(r["prefill_tok_s"])
        lines.append(
            f"| {r['tp']} | {r['threads_per_rank']} | {d:.1f} [{min(r['decode_tok_s']):.1f}-"
            f"{max(r['decode_tok_s']):.1f}] | {d / base_decode:.2f}x | {p:.0f} | {p / base_prefill:.2f}x | "
            f"{r['comm_ms_median']:.2f} | {r['broadcast_ms_median']:.2f} | {r['comm_share_median']:.0%} |"
        )
    return lines


def main(args) -> None:
    import torch

    from ember.bench.lib import random_model

    tmp = None
    load = load_average()
    if args.model:
        path, label = args.model, args.model
    else:
        shape = {**random_model.QWEN3, **SHAPES[args.shape]}
        logger.info("bench tp: writing a random %s", shape["label"])
        path, _ = random_model.build_model(shape, torch.device("cpu"))
        tmp, label = path, shape["label"]
    try:
        knobs = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory, "max_model_len": args.prompt_len + 64}
        rows = [
            measure(path, tp, runs=args.runs, decode_tokens=args.decode_tokens, prompt_len=args.prompt_len, knobs=knobs)
            for tp in args.sizes
        ]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    about = [
        f"model: {label}",
        f"{args.runs} runs; decode {args.decode_tokens} tokens at batch 1 (per-step medians), prefill one "
        f"{args.prompt_len}-token prompt; every rank gets cores / N torch threads",
        "comm = rank 0's time in the model's all-reduce / all-gather per decode step; broadcast = sending the "
        "step's inputs to the workers; share = (comm + broadcast) / step wall time",
    ]
    data = {
        "model": label,
        "runs": args.runs,
        "decode_tokens": args.decode_tokens,
        "prompt_len": args.prompt_len,
        "rows": rows,
    }
    command = command_line(
        args,
        [
            "model" if args.model else "shape",
            "sizes",
            "runs",
            "decode_tokens",
            "prompt_len",
            "dtype",
            "kv_cache_memory",
            "output",
        ],
        engine=False,
    )
    Result(KIND, "Tensor parallelism (CPU, gloo)", command, load, about, [], table(rows), data).publish(
        args.output, header=HEADER, json_file=Path(args.output).with_suffix(".json")
    )


def add_cli_args(p) -> None:
    p.add_argument("--model", default=None, help="model folder (default: a random model of --shape)")
    p.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    p.add_argument("--sizes", type=int_list, default=[1, 2], metavar="N,N", help="tensor-parallel sizes")
    p.add_argument("--runs", type=positive_int, default=3)
    p.add_argument("--decode-tokens", type=positive_int, default=32)
    p.add_argument("--prompt-len", type=positive_int, default=512)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", type=float, default=0.5)
    p.add_argument("--output", default="benchmarks/tp.md")
