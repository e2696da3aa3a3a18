"""Offline batched throughput: N random prompts of input_len tokens, output_len tokens each.

Also home of what latency.py shares: the workload (seeded random prompts) and the paired
measuring protocol (wait for a quiet machine, then ember and the peer back to back).
"""
from __future__ import annotations

import logging
import random
import time
from typing import Callable

from tqdm import tqdm

from ember.bench.report import CONTENDED_CORES, Bar, Metric, OthersLoad, wait_for_quiet
from ember.sampling import SamplingParams

logger = logging.getLogger("ember.bench")

WARMUP_SEED = 10_000  # warmup prompts never repeat a measured run's prompts


class PromptMaker:
    """Seeded random token prompts drawn from the ordinary vocabulary (special tokens left out,
    so no BOS/EOS/chat markers land mid-prompt). The same seed gives the same prompts, so ember
    and the peer see identical inputs; a new seed per run keeps the prefix cache from helping."""

    def __init__(self, vocab_size: int, special_ids: set[int], base_seed: int = 0):
        self.pool = [t for t in range(vocab_size) if t not in special_ids]
        self.base_seed = base_seed

    def make(self, n: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(self.base_seed * 1_000_000_007 + seed)
        return [rng.choices(self.pool, k=length) for _ in range(n)]


def prompt_maker(llm, base_seed: int = 0) -> PromptMaker:
    tok = llm.get_tokenizer()
    vocab = min(tok.vocab_size, llm.engine.model_config.vocab_size)
    return PromptMaker(vocab, set(tok.all_special_ids), base_seed)


RETRIES = 2  # a pair measured while others kept > CONTENDED_CORES busy is redone up to this often


def measure_pair(run: int, make_pair: Callable[[int], tuple[Callable[[], dict], Callable[[], dict] | None]],
                 quiet_wait_s: float) -> list[tuple[str, dict, float | None]]:
    """Run ember and the peer back to back; [(side, values, others' cores)].

    `make_pair(attempt)` gives the two measurements on that attempt's inputs: a redone pair must
    get fresh prompts, or ember's prefix cache would serve the prompt it has just seen. For
    measured runs (run >= 0): first wait for the machine to go quiet, and redo the pair (up to
    RETRIES times) when someone else's job took over half a core during either side. Who goes
    first alternates by run, so drift on the shared machine favours neither side."""
    for attempt in range(RETRIES + 1):
        ember_fn, peer_fn = make_pair(attempt)
        sides = [("ember", ember_fn)] + ([("peer", peer_fn)] if peer_fn else [])
        if run % 2:
            sides.reverse()
        if run >= 0 and quiet_wait_s > 0:
            wait_for_quiet(quiet_wait_s)
        out = []
        for side, fn in sides:
            with OthersLoad() as load:
                values = fn()
            out.append((side, values, load.cores))
        worst = max((o or 0.0) for _, _, o in out)
        if run < 0 or worst <= CONTENDED_CORES or attempt == RETRIES:
            return out
        logger.info("bench: other processes used %.2f cores during a measurement; measuring the pair again", worst)
    return out


def prompt_seed(run: int, attempt: int, salt: int = 0) -> int:
    """A seed per (run, attempt, salt): warmup (run -1) and every redo get prompts of their own."""
    return (WARMUP_SEED if run < 0 else run) + 100_000 * attempt + 7919 * salt


def ember_batch(llm, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """One LLM.generate over all prompts; returns (seconds, generated tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    assert not any(o.num_cached_tokens for o in outs), "the prefix cache served a benchmark prompt; prompts must be fresh"
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == output_len * len(prompts), f"ember generated {generated} tokens, wanted {output_len * len(prompts)}"
    return seconds, generated


OUTPUT_METRIC = "output throughput"
TOTAL_METRIC = "total throughput (in + out)"


def bars(num_prompts: int, input_len: int, output_len: int) -> list[Bar]:
    return [Bar(f"batched throughput ({num_prompts} prompts, {input_len} in / {output_len} out) >= 1.5x "
                "transformers batched generate", OUTPUT_METRIC, 1.5)]


def run(llm, peer, *, num_prompts: int, input_len: int, output_len: int, runs: int, quiet_wait_s: float = 0.0,
        prompt_seed_base: int = 0) -> list[Metric]:
    """Warm up once, then `runs` rounds of ember and peer on the same fresh prompts; tok/s per round."""
    make = prompt_maker(llm, prompt_seed_base)
    metrics = {name: Metric(name, "tok/s", True, peer=[] if peer else None) for name in (OUTPUT_METRIC, TOTAL_METRIC)}

    def rates(measure) -> dict:
        seconds, generated = measure()
        return {OUTPUT_METRIC: generated / seconds, TOTAL_METRIC: (generated + num_prompts * input_len) / seconds,
                "seconds": seconds}

    for r in tqdm(range(-1, runs), desc="bench throughput", unit="run", dynamic_ncols=True):
        def make_pair(attempt: int):
            prompts = make.make(num_prompts, input_len, prompt_seed(r, attempt))
            return (lambda: rates(lambda: ember_batch(llm, prompts, output_len)),
                    (lambda: rates(lambda: peer.batch(prompts, output_len))) if peer else None)

        pair = measure_pair(r, make_pair, quiet_wait_s)
        for side, values, others in pair:
            logger.info("bench throughput %s %s: %d prompts in %.2fs, %.1f out tok/s, %.1f total tok/s "
                        "(others used %s cores)", side, "warmup" if r < 0 else f"run {r + 1}/{runs}", num_prompts,
                        values["seconds"], values[OUTPUT_METRIC], values[TOTAL_METRIC], others)
            if r >= 0:
                for name, m in metrics.items():
                    m.add(side, values[name], others)
    return list(metrics.values())
