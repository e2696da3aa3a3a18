"""`ember bench latency`: batch-1 greedy decode speed after the first token, and time to first token
(TTFT), ember against transformers on the same weights in the same runs.

Both are taken through the engine's step loop (lib/timing.py), so TTFT includes scheduling and
sampling, not just the forward. Decode is reported as mean and steady (1 / median gap); on a quiet
machine the two agree, so the bar is judged on the steady figure.
"""

from __future__ import annotations

from ember.bench.lib.args import add_common_args, command_line, int_list
from ember.bench.lib.bar import Bar
from ember.bench.lib.cpu import protocol_note
from ember.bench.lib.machine import load_average
from ember.bench.lib.metric import Metric, measure_runs, paired_result, speedup_bar
from ember.bench.lib.prompts import prompt_maker, prompt_seed
from ember.bench.lib.timing import DECODE_PROMPT_LEN, decode_rates, ember_decode, ember_ttft

NAME = "latency"
HELP = "batch-1 decode tok/s and time to first token"
DECODE_METHOD = "ember decode: engine.step() loop, each token timestamped when its step returns"
RATES_METHOD = (
    "decode, both sides: mean = (N - 1) / (last token time - first token time); steady = 1 / median gap "
    "between tokens, robust to a burst of other work (bars use steady; on a quiet machine they agree)"
)
TTFT_METHOD = "ember TTFT: engine.add_request() to the step that returns the first token (max_tokens=1)"
FLAGS = ["runs", "peer", "output", "prompt_seed", "quiet_wait", "decode_tokens", "prompt_lens"]


def add_cli_args(p) -> None:
    add_common_args(p)
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens generated for the decode figure (>= 2)")
    p.add_argument(
        "--prompt-lens", type=int_list, default=[128, 512, 2048], metavar="N,N,...", help="prompt lengths for TTFT"
    )


def decode_metric_name(n: int, steady: bool) -> str:
    return f"batch-1 decode, {n} tokens, {'steady (median gap)' if steady else 'mean'}"


def ttft_metric_name(length: int) -> str:
    return f"TTFT, {length}-token prompt"


def bars(metrics: list[Metric], decode_tokens: int, prompt_lens: list[int]) -> list[Bar]:
    out = [speedup_bar("batch-1 decode >= 2x transformers bf16", metrics, decode_metric_name(decode_tokens, True), 2.0)]
    if 2048 in prompt_lens:
        # TTFT is lower-is-better; its speedup is peer time / ember time, so "no worse" is >= 1
        out.append(
            speedup_bar("TTFT at 2048 tokens no worse than transformers bf16", metrics, ttft_metric_name(2048), 1.0)
        )
    return out


def run(
    llm,
    peer,
    *,
    decode_tokens: int,
    prompt_lens: list[int],
    runs: int,
    quiet_wait_s: float = 0.0,
    prompt_seed_base: int = 0,
) -> list[Metric]:
    """One warmup round, then `runs` rounds; each round measures ember and the peer on the same
    freshly seeded prompts (a new prompt per round, so the prefix cache cannot help)."""
    engine = llm.engine
    make = prompt_maker(llm, prompt_seed_base)
    mean = Metric(decode_metric_name(decode_tokens, False), "tok/s", True, peer=[] if peer else None)
    steady = Metric(decode_metric_name(decode_tokens, True), "tok/s", True, peer=[] if peer else None)
    ttfts = {n: Metric(ttft_metric_name(n), "ms", False, peer=[] if peer else None) for n in prompt_lens}

    def decode(times: list[float]) -> dict:
        m, s = decode_rates(times)
        return {mean.name: m, steady.name: s}

    def pairs(r: int) -> list:
        def decode_pair(attempt: int):
            p = make.make(1, DECODE_PROMPT_LEN, prompt_seed(r, attempt))[0]
            return (
                lambda: decode(ember_decode(engine, f"bench-decode-{r}-{attempt}", p, decode_tokens)),
                (lambda: decode(peer.decode(p, decode_tokens))) if peer else None,
            )

        def ttft_pair(n: int, m: Metric):
            def make_pair(attempt: int):
                p = make.make(1, n, prompt_seed(r, attempt, salt=n))[0]
                return (
                    lambda: {m.name: 1000 * ember_ttft(engine, f"bench-ttft-{r}-{n}-{attempt}", p)},
                    (lambda: {m.name: 1000 * peer.ttft(p)}) if peer else None,
                )

            return make_pair

        return [decode_pair, *(ttft_pair(n, m) for n, m in ttfts.items())]

    metrics = [mean, steady, *ttfts.values()]
    measure_runs("bench latency", runs, pairs, metrics, quiet_wait_s)
    return metrics


def main(args) -> None:
    from ember.bench.peers import hf
    from ember.bench.sides.ember import engine_and_peer
    from ember.errors import ConfigError

    if args.decode_tokens < 2:
        raise ConfigError(
            f"--decode-tokens must be >= 2 to time decode after the first token (got {args.decode_tokens})"
        )
    llm, peer, ember_desc = engine_and_peer(args)
    load = load_average()
    metrics = run(
        llm,
        peer,
        decode_tokens=args.decode_tokens,
        prompt_lens=args.prompt_lens,
        runs=args.runs,
        quiet_wait_s=args.quiet_wait,
        prompt_seed_base=args.prompt_seed,
    )
    notes = [
        protocol_note(args.quiet_wait),
        DECODE_METHOD,
        RATES_METHOD,
        TTFT_METHOD,
        f"decode uses a {DECODE_PROMPT_LEN}-token prompt; all prompts are seeded random ordinary tokens, new each run",
    ]
    if peer:
        notes += [hf.DECODE_METHOD, hf.TTFT_METHOD]
    paired_result(
        "latency",
        "Latency (batch 1)",
        command_line(args, FLAGS),
        args.runs,
        metrics,
        bars(metrics, args.decode_tokens, args.prompt_lens),
        ember_desc,
        peer.description if peer else None,
        notes,
        load,
    ).publish(args.output)
