"""`ember bench throughput`: offline batched generation, N random prompts of input_len tokens and
output_len tokens each, ember's LLM.generate against transformers' batched generate in the same runs.
"""

from __future__ import annotations

from ember.bench.lib.args import add_common_args, command_line, positive_int
from ember.bench.lib.cpu import protocol_note
from ember.bench.lib.machine import load_average
from ember.bench.lib.metric import Metric, measure_runs, paired_result, speedup_bar
from ember.bench.lib.prompts import prompt_maker, prompt_seed
from ember.bench.lib.timing import ember_batch

NAME = "throughput"
HELP = "offline batched generation tok/s"
OUTPUT_METRIC = "output throughput"
TOTAL_METRIC = "total throughput (in + out)"
FLAGS = ["runs", "peer", "output", "prompt_seed", "quiet_wait", "num_prompts", "input_len", "output_len"]


def add_cli_args(p) -> None:
    add_common_args(p)
    p.add_argument("--num-prompts", type=positive_int, default=32)
    p.add_argument("--input-len", type=positive_int, default=128)
    p.add_argument("--output-len", type=positive_int, default=128)


def run(
    llm,
    peer,
    *,
    num_prompts: int,
    input_len: int,
    output_len: int,
    runs: int,
    quiet_wait_s: float = 0.0,
    prompt_seed_base: int = 0,
) -> list[Metric]:
    """Warm up once, then `runs` rounds of ember and peer on the same fresh prompts; tok/s per round."""
    make = prompt_maker(llm, prompt_seed_base)

    def rates(measure) -> dict:
        seconds, generated = measure()
        return {
            OUTPUT_METRIC: generated / seconds,
            TOTAL_METRIC: (generated + num_prompts * input_len) / seconds,
            "seconds": seconds,
        }

    def pairs(r: int) -> list:
        def make_pair(attempt: int):
            prompts = make.make(num_prompts, input_len, prompt_seed(r, attempt))
            return (
                lambda: rates(lambda: ember_batch(llm, prompts, output_len)),
                (lambda: rates(lambda: peer.batch(prompts, output_len))) if peer else None,
            )

        return [make_pair]

    metrics = [Metric(name, "tok/s", True, peer=[] if peer else None) for name in (OUTPUT_METRIC, TOTAL_METRIC)]
    measure_runs("bench throughput", runs, pairs, metrics, quiet_wait_s)
    return metrics


def main(args) -> None:
    from ember.bench.peers import hf
    from ember.bench.sides.ember import engine_and_peer

    # the peer runs all prompts as one batch; give ember the same batch unless told otherwise
    llm, peer, ember_desc = engine_and_peer(args, batch=args.num_prompts)
    load = load_average()
    metrics = run(
        llm,
        peer,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        runs=args.runs,
        quiet_wait_s=args.quiet_wait,
        prompt_seed_base=args.prompt_seed,
    )
    notes = [
        protocol_note(args.quiet_wait),
        "ember: one LLM.generate() over all prompts (ignore_eos), tok/s over the whole call",
        f"{args.num_prompts} seeded random prompts of ordinary tokens, new each run, "
        f"{args.input_len} in / {args.output_len} out each",
    ]
    if peer:
        notes.append(hf.BATCH_METHOD)
    bar = speedup_bar(
        f"batched throughput ({args.num_prompts} prompts, {args.input_len} in / {args.output_len} out) "
        ">= 1.5x transformers batched generate",
        metrics,
        OUTPUT_METRIC,
        1.5,
    )
    paired_result(
        "throughput",
        "Throughput (offline batch)",
        command_line(args, FLAGS),
        args.runs,
        metrics,
        [bar],
        ember_desc,
        peer.description if peer else None,
        notes,
        load,
    ).publish(args.output)
