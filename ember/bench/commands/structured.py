"""`ember bench structured`: decode with a JSON-schema constraint against the same decode without it,
same engine, same prompts, same run -- what a grammar costs per token.

Both sides generate exactly --output-len tokens per request: the schema asks for a list of at least
MIN_ITEMS objects, which no answer finishes within that, and the free side ignores EOS. Decode tok/s
counts the tokens generated after every request of the batch had its first one, over the time
since (prefill and grammar compile stay out; the mask's fill and apply, every step, are in).
The two sides alternate within each run; the figure is the median of the per-run ratios. The
engine runs as configured (on the default model: MTP speculation on, so a constrained step also
walks the drafts through the grammar). The "peer" column is the unconstrained side.
"""

from __future__ import annotations

import logging
import time

from ember.bench.lib.args import add_benchmark_group, command_line
from ember.bench.lib.cpu import CpuMeter, wait_for_quiet
from ember.bench.lib.machine import load_average
from ember.bench.lib.metric import Metric, paired_result, speedup_bar

logger = logging.getLogger("ember.bench")

NAME = "structured"
HELP = (
    "decode tok/s with a JSON-schema constraint vs without, batch 1 and 32, same run (default model unless a "
    "model is given)"
)

MIN_ITEMS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "products": {
            "type": "array",
            "minItems": MIN_ITEMS,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 32},
                    "price": {"type": "number", "minimum": 0, "maximum": 10000},
                    "in_stock": {"type": "boolean"},
                },
                "required": ["id", "name", "price", "in_stock"],
            },
        }
    },
    "required": ["products"],
}
SHOPS = [
    "a bakery",
    "a bike shop",
    "a bookstore",
    "a hardware store",
    "a pharmacy",
    "a toy shop",
    "a florist",
    "a music store",
]
BATCHES = (1, 32)
BARS = {1: 0.9, 32: 0.85}


def prompts(tokenizer, n: int, run: int) -> list[str]:
    """n chat prompts asking for a product list (new shops and counts each run)."""
    out = []
    for i in range(n):
        shop = SHOPS[(i + run) % len(SHOPS)]
        text = f"List {20 + (i * 7 + run) % 50} products sold by {shop}, with id, name, price and stock, as JSON."
        out.append(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        )
    return out


def decode_rate(engine, texts: list[str], params) -> float:
    """Output tok/s after every request had its first token (see the module doc)."""
    for i, text in enumerate(texts):
        engine.add_request(f"bench-{time.monotonic_ns()}-{i}", text, params)
    produced: dict[str, int] = {}
    started = end = None
    counted = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        new = 0
        for o in outs:
            n = sum(len(c.token_ids) for c in o.outputs)
            new += n - produced.get(o.request_id, 0)
            produced[o.request_id] = n
        if started is None:
            if len(produced) == len(texts) and min(produced.values()) >= 1:
                started = now
        else:
            counted += new
            end = now
    if started is None or end is None or end <= started:
        raise RuntimeError("the decode window was empty; raise --output-len")
    return counted / (end - started)


class _MaskClock:
    """The engine's structured-output listener for the run: compile and per-step mask seconds."""

    def __init__(self):
        self.compile: list[float] = []
        self.mask: list[float] = []

    def observe_compile(self, seconds: float) -> None:
        self.compile.append(seconds)

    def observe_mask(self, seconds: float) -> None:
        self.mask.append(seconds)


def run(llm, runs: int, output_len: int, quiet_wait_s: float):
    from ember.sampling import SamplingParams
    from ember.structured_params import StructuredOutputsParams

    engine = llm.engine
    clock = _MaskClock()
    engine.structured.listener = clock
    free = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    constrained = free.replace(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    metrics = {b: Metric(f"batch-{b} decode", "tok/s", True, peer=[]) for b in BATCHES}
    tok = llm.get_tokenizer()
    for b in BATCHES:  # warmup: compile the grammar, touch every shape once
        decode_rate(engine, prompts(tok, b, -1), constrained)
        decode_rate(engine, prompts(tok, b, -1), free)
    clock.mask.clear()
    for r in range(runs):
        for b in BATCHES:
            texts = prompts(tok, b, r)
            wait_for_quiet(quiet_wait_s)
            for side, params in (
                (("ember", constrained), ("peer", free)) if r % 2 == 0 else (("peer", free), ("ember", constrained))
            ):
                with CpuMeter() as load:
                    rate = decode_rate(engine, texts, params)
                metrics[b].add(side, rate, load.others)
                logger.info(
                    "bench structured: run %d batch %d %s %.1f tok/s",
                    r,
                    b,
                    "constrained" if side == "ember" else "free",
                    rate,
                )
    engine.structured.listener = None
    return [metrics[b] for b in BATCHES], clock


def main(args) -> None:
    import dataclasses
    import statistics

    from ember.config.engine_args import engine_config_from_args
    from ember.llm import LLM

    config = engine_config_from_args(args)
    if config.max_num_seqs is None:
        config = dataclasses.replace(config, max_num_seqs=max(BATCHES))
    llm = LLM(**config.flags())
    llm.wait_for_compile()
    engine = llm.engine
    load = load_average()
    metrics, clock = run(llm, args.runs, args.output_len, args.quiet_wait)
    mask_ms = statistics.median(clock.mask) * 1e3 if clock.mask else float("nan")
    ember_desc = {
        "model": str(engine.parts.loaded.path).rsplit("/", 1)[-1],
        "dtype": str(engine.parts.setup.dtype).removeprefix("torch."),
        "executor": engine.parts.limits.executor,
        "speculation": "on" if engine.parts.spec is not None else "off",
        "max_num_seqs": engine.parts.limits.max_num_seqs,
        "constraint": "JSON schema (xgrammar)",
    }
    peer = {"name": "unconstrained", "what": "the same engine, prompts and token count, no constraint (ignore_eos)"}
    notes = [
        __doc__.split("\n\n", 1)[1].replace("\n", " ").strip(),
        f"median mask time per constrained step (fill + apply, all rows of the step): {mask_ms:.3f} ms; "
        f"grammar compiles: {len(clock.compile)} ({', '.join(f'{s * 1e3:.0f} ms' for s in clock.compile)})",
    ]
    bars = [
        speedup_bar(f"constrained batch-{b} decode >= {x}x unconstrained", metrics, f"batch-{b} decode", x)
        for b, x in BARS.items()
    ]
    paired_result(
        "structured",
        "Structured outputs: JSON-schema decode vs the same decode unconstrained",
        command_line(args, ["runs", "output", "quiet_wait", "output_len"]),
        args.runs,
        metrics,
        bars,
        ember_desc,
        peer,
        notes,
        load,
    ).publish(args.output)


def add_cli_args(p) -> None:
    g = add_benchmark_group(p)
    g.add_argument("--runs", type=int, default=3, help="measured runs after one warmup; medians of per-run ratios")
    g.add_argument("--output-len", type=int, default=128, help="tokens generated per request on both sides")
    g.add_argument("--output", default="benchmarks/structured.md", help="markdown results file (and its JSON)")
    g.add_argument(
        "--quiet-wait",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="before each batch size of each run, wait up to this long for other processes to leave the CPU idle",
    )
