"""`ember bench gdn-prefill`: the prefill recurrence of one Gated DeltaNet layer on CPU, two ways.

Issue 40 asks for whichever of a fused token-sequential or a chunked prefill recurrence wins a
measured A/B at 512 and 2,000 tokens. The two here start from the same conv output, a and b (what
GatedDeltaNet has in hand after its conv) and end with the same output and final state:
- fused: the C++ op (ember_cpu::gated_delta_net, N = 1 sequence of L tokens): gates, L2 norms and
  the recurrence token by token, each value head's fp32 state held in L1 a stripe at a time;
- chunked: the torch reference's chunked form (layers/gated_delta_rule.py: the gates, prepare_qk,
  then chunks of 64 tokens in batched matmuls and a triangular solve), which the layer ran before.
Rounds alternate the order of the two; each cell is the median [min-max] over rounds of one call's
wall time, and the ratio is taken round by round. Each row also carries the largest difference
between the two outputs and the final states' relative difference, so a fast but wrong kernel
cannot hide in the table.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.nn.functional as F

from ember.bench.lib.args import command_line, int_list, positive_int
from ember.bench.lib.machine import load_average
from ember.bench.lib.markdown import ratio_cell, row
from ember.bench.lib.result import Result
from ember.errors import ConfigError
from ember.kernels import cpu_gated_delta_net
from ember.layers import gated_delta_rule as gdr

logger = logging.getLogger("ember.bench")

NAME = KIND = "gdn-prefill"
HELP = "one Gated DeltaNet layer's prefill recurrence on CPU: the fused C++ op against the torch chunked form"
TITLE = "Gated DeltaNet prefill recurrence on CPU: fused token-sequential (C++) against chunked (torch)"

# (key heads, value heads, dk, dv) of the layers ember serves
SHAPES = {
    "qwen3.5-0.8b": (16, 16, 128, 128),
    "qwen3.5-27b": (16, 48, 128, 128),
    "qwen3-next-80b": (16, 32, 128, 128),
}


def case(shape: tuple, L: int, seed: int = 0) -> dict:
    """A layer's inputs after its conv: qkv [L, C] bf16, a, b [L, Hv], A_log, dt_bias [Hv]."""
    Hk, Hv, dk, dv = shape
    g = torch.Generator().manual_seed(seed)
    bf16 = torch.bfloat16
    return {
        "qkv": torch.randn(L, 2 * Hk * dk + Hv * dv, generator=g).to(bf16),
        "a": torch.randn(L, Hv, generator=g).to(bf16),
        "b": torch.randn(L, Hv, generator=g).to(bf16),
        "A_log": (torch.rand(Hv, generator=g) * 2 - 1).to(bf16),
        "dt_bias": (torch.randn(Hv, generator=g) * 0.5).to(bf16),
        "shape": shape,
    }


def fused(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    Hk, Hv, dk, dv = c["shape"]
    state = torch.empty(1, Hv, dk, dv)
    idx = torch.tensor([-1]), torch.tensor([0])
    o = cpu_gated_delta_net.gated_delta_net(c["qkv"], c["a"], c["b"], c["A_log"], c["dt_bias"], state, *idx)
    return o, state[0]


def chunked(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    Hk, Hv, dk, dv = c["shape"]
    L = c["qkv"].shape[0]
    q, k, v = c["qkv"].split([Hk * dk, Hk * dk, Hv * dv], dim=-1)
    g = -c["A_log"].float().exp() * F.softplus(c["a"].float() + c["dt_bias"])
    beta = c["b"].sigmoid()
    q, k = gdr.prepare_qk(q.reshape(L, Hk, dk), k.reshape(L, Hk, dk), Hv)
    o, state = gdr.chunked(q, k, v.reshape(L, Hv, dv), g, beta, torch.zeros(Hv, dk, dv))
    return o.to(c["qkv"].dtype).reshape(L, Hv * dv), state


def chunked_flushed(c: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """chunked with denormals flushed to zero: its exp(cumulative decay) within a 64-token chunk falls
    into float32's denormal range when the decay is strong, and x86 takes those slowly."""
    torch.set_flush_denormal(True)
    try:
        return chunked(c)
    finally:
        torch.set_flush_denormal(False)  # torch's default, what the engine runs with


WAYS = {"fused": fused, "chunked": chunked, "chunked_ftz": chunked_flushed}


def measure(shape: tuple, L: int, runs: int) -> dict:
    """One (shape, L) row: per way the seconds of each round, the ratios round by round, the errors."""
    c = case(shape, L)
    with torch.inference_mode():
        out = {name: way(c) for name, way in WAYS.items()}  # warmup, and the outputs compared
        times: dict[str, list[float]] = {name: [] for name in WAYS}
        for r in range(runs):
            for name in WAYS if r % 2 == 0 else reversed(WAYS):
                t = time.perf_counter()
                WAYS[name](c)
                times[name].append(time.perf_counter() - t)
    (o_f, s_f), (o_c, s_c) = out["fused"], out["chunked"]

    def ratio(other: str) -> dict:
        rs = [f / o for f, o in zip(times["fused"], times[other])]
        return {"median": statistics.median(rs), "min": min(rs), "max": max(rs)}

    return {
        "tokens": L,
        "seconds": times,
        "ratio": ratio("chunked"),
        "ratio_ftz": ratio("chunked_ftz"),
        "max_abs_out_diff": (o_f.float() - o_c.float()).abs().max().item(),
        "state_rel_diff": ((s_f - s_c).norm() / s_c.norm()).item(),
    }


def spread_ms(values: list[float]) -> str:
    ms = [v * 1e3 for v in values]
    return f"{statistics.median(ms):.1f} [{min(ms):.1f}-{max(ms):.1f}]"


def table(rows: dict) -> list[str]:
    lines = [
        "| layer shape (Hk, Hv, dk, dv) | prompt tokens | fused C++ (ms) | torch chunked (ms) | torch chunked, "
        "denormals flushed (ms) | fused / chunked | fused / chunked flushed | max abs out diff | final state rel diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape_name, by_len in rows.items():
        for r in by_len:
            dims = ", ".join(map(str, SHAPES[shape_name]))
            cells = [f"{shape_name} ({dims})", str(r["tokens"]), spread_ms(r["seconds"]["fused"])]
            cells += [spread_ms(r["seconds"]["chunked"]), spread_ms(r["seconds"]["chunked_ftz"])]
            cells += [ratio_cell(r["ratio"]), ratio_cell(r["ratio_ftz"])]
            cells += [f"{r['max_abs_out_diff']:.2g}", f"{r['state_rel_diff']:.2g}"]
            lines.append(row(cells))
    return lines


def main(args) -> None:
    if not cpu_gated_delta_net.available():
        raise ConfigError(
            "the fused Gated DeltaNet C++ op is not built on this machine (it needs AVX-512 or AVX2 + FMA)"
        )
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        raise ConfigError(f"unknown --shapes {unknown}: choose from {', '.join(SHAPES)}")
    torch.set_num_threads(args.threads)
    load = load_average()
    rows = {}
    for name in args.shapes:
        rows[name] = [measure(SHAPES[name], L, args.runs) for L in args.prompt_lens]
        logger.info("bench gdn-prefill: %s done", name)
    about = [
        f"{args.threads} torch threads; inputs random (bf16 conv output, a, b; seeded), a new sequence "
        "(zero initial state); both ways end with the output and the final fp32 state",
        "fused: ember_cpu::gated_delta_net over one sequence of L tokens; chunked: layers/gated_delta_rule.py's "
        "gates, prepare_qk and chunked (64-token chunks), what GatedDeltaNet ran on CPU before; chunked, denormals "
        "flushed: the same under torch.set_flush_denormal(True) (the decay's exp within a chunk reaches float32's "
        "denormals, which x86 takes slowly); the diffs are fused against chunked",
        "decay: A_log uniform in [-1, 1], dt_bias N(0, 0.25), a and b N(0, 1) (HF's Qwen3.5 init draws A in "
        "(0, 16): a stronger decay than here)",
        f"{args.runs} measured rounds after a warmup, order alternating; cells are median [min-max] of one "
        "call's wall time; the ratio is taken round by round",
    ]
    command = command_line(args, ["shapes", "prompt_lens", "runs", "threads", "output"], engine=False)
    Result(KIND, TITLE, command, load, about, [], table(rows), {"rows": rows}).publish(args.output)


def add_cli_args(p) -> None:
    p.add_argument(
        "--shapes",
        type=lambda s: [x.strip() for x in s.split(",") if x.strip()],
        default=list(SHAPES),
        help=f"layer shapes, comma-separated, from {', '.join(SHAPES)}",
    )
    p.add_argument("--prompt-lens", type=int_list, default=[512, 2000], help="prompt lengths (tokens)")
    p.add_argument("--runs", type=positive_int, default=5, help="measured rounds after one warmup")
    p.add_argument("--threads", type=positive_int, default=2, help="torch threads (the op's too)")
    p.add_argument("--output", default="benchmarks/gdn-prefill.md", help="markdown file; the JSON goes beside it")
