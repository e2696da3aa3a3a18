"""Offline batched throughput: N random prompts of input_len tokens, output_len tokens each.

Also home of the benchmark workload itself (seeded random prompts), which latency.py shares.
"""
from __future__ import annotations

import logging
import random
import time

from tqdm import tqdm

from ember.bench.report import Bar, Metric
from ember.sampling import SamplingParams

logger = logging.getLogger("ember.bench")

WARMUP_SEED = 10_000  # warmup prompts never repeat a measured run's prompts


class PromptMaker:
    """Seeded random token prompts drawn from the ordinary vocabulary (special tokens left out,
    so no BOS/EOS/chat markers land mid-prompt). The same seed gives the same prompts, so ember
    and the peer see identical inputs; a new seed per run keeps the prefix cache from helping."""

    def __init__(self, vocab_size: int, special_ids: set[int]):
        self.pool = [t for t in range(vocab_size) if t not in special_ids]

    def make(self, n: int, length: int, seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [rng.choices(self.pool, k=length) for _ in range(n)]


def prompt_maker(llm) -> PromptMaker:
    tok = llm.get_tokenizer()
    vocab = min(tok.vocab_size, llm.engine.model_config.vocab_size)
    return PromptMaker(vocab, set(tok.all_special_ids))


def ember_batch(llm, prompts: list[list[int]], output_len: int) -> tuple[float, int]:
    """One LLM.generate over all prompts; returns (seconds, generated tokens)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    assert generated == output_len * len(prompts), f"ember generated {generated} tokens, wanted {output_len * len(prompts)}"
    return seconds, generated


def bars(num_prompts: int, input_len: int, output_len: int) -> list[Bar]:
    return [Bar(f"batched throughput ({num_prompts} prompts, {input_len} in / {output_len} out) >= 1.5x "
                "transformers batched generate", OUTPUT_METRIC, 1.5)]


OUTPUT_METRIC = "output throughput"
TOTAL_METRIC = "total throughput (in + out)"


def run(llm, peer, *, num_prompts: int, input_len: int, output_len: int, runs: int) -> list[Metric]:
    """Warm up once, then `runs` rounds of ember and peer on the same fresh prompts; tok/s per round."""
    make = prompt_maker(llm)
    out_m = Metric(OUTPUT_METRIC, "tok/s", True, peer=[] if peer else None)
    tot_m = Metric(TOTAL_METRIC, "tok/s", True, peer=[] if peer else None)
    for r in tqdm(range(-1, runs), desc="bench throughput", unit="run", dynamic_ncols=True):
        prompts = make.make(num_prompts, input_len, WARMUP_SEED if r < 0 else r)
        sides = [("ember", lambda: ember_batch(llm, prompts, output_len))]
        if peer:
            sides.append(("peer", lambda: peer.batch(prompts, output_len)))
            if r % 2:  # alternate who goes first, so drift on the shared machine favours neither
                sides.reverse()
        for side, measure in sides:
            seconds, generated = measure()
            total = generated + num_prompts * input_len
            logger.info("bench throughput %s %s: %d prompts in %.2fs, %.1f out tok/s, %.1f total tok/s", side,
                        "warmup" if r < 0 else f"run {r + 1}/{runs}", num_prompts, seconds, generated / seconds,
                        total / seconds)
            if r < 0:
                continue
            (out_m.ember if side == "ember" else out_m.peer).append(generated / seconds)
            (tot_m.ember if side == "ember" else tot_m.peer).append(total / seconds)
    return [out_m, tot_m]
