"""Issue 40's prefix-cache bar for hybrids: the second turn of a 4K-token conversation, after a burst of
other requests, gets a TTFT of at most 10% of a cold one.

    python scripts/hybrid_prefix_burst.py [MODEL] [--turn1 4096] [--burst 32] [--lo 500] [--hi 1500]

MODEL: a hybrid model (default: `ember bench hybrid`'s bf16 file of the random Qwen3.5-0.8B shape).
Turn 1 is a fresh prompt of --turn1 random tokens with a --answer-token answer, timed cold; then
--burst fresh prompts of --lo..--hi tokens run as one LLM.generate (--answer tokens each); then
turn 2 (turn 1's prompt and answer, then --followup new tokens) is timed, and so is a cold prompt
of turn 2's length, so both TTFTs are measured in the same run. Prints the hit (prompt tokens served
from the cache) and the TTFTs.
"""

from __future__ import annotations

import argparse
import os
import random
import time

from ember import LLM, SamplingParams

DEFAULT_MODEL = os.path.expanduser("~/.cache/ember/bench/qwen3.5-0.8b-shape-random.bf16.gguf")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("--turn1", type=int, default=4096)
    p.add_argument("--burst", type=int, default=32)
    p.add_argument("--lo", type=int, default=500)
    p.add_argument("--hi", type=int, default=1500)
    p.add_argument("--answer", type=int, default=16)
    p.add_argument("--followup", type=int, default=40)
    p.add_argument("--max-model-len", type=int, default=8192)
    args = p.parse_args()

    llm = LLM(model=args.model, max_model_len=args.max_model_len)
    engine = llm.engine
    vocab = engine.parts.loaded.model_config.vocab_size
    rng = random.Random(0)

    def fresh(n: int) -> list[int]:
        return [rng.randrange(100, min(vocab, 32000)) for _ in range(n)]

    greedy = SamplingParams(temperature=0.0, max_tokens=args.answer, ignore_eos=True)
    llm.generate([{"prompt_token_ids": fresh(64)}], greedy, use_tqdm=False)  # warm up
    states = engine.parts.kv.states
    say(f"model {args.model}")
    say(
        f"state slots: {states.num_live} live + {states.num_snapshots} snapshots; KV {engine.parts.kv.num_blocks} blocks"
    )

    turn1 = fresh(args.turn1)
    t0 = time.perf_counter()
    first = llm.generate([{"prompt_token_ids": turn1}], greedy, use_tqdm=False)[0]
    say(f"turn 1: {args.turn1} tokens + {args.answer} answer in {time.perf_counter() - t0:.2f} s")
    answer = list(first.outputs[0].token_ids)

    t0 = time.perf_counter()
    burst = [fresh(rng.randint(args.lo, args.hi)) for _ in range(args.burst)]
    llm.generate([{"prompt_token_ids": b} for b in burst], greedy, use_tqdm=False)
    say(f"burst: {args.burst} prompts of {args.lo}-{args.hi} tokens in {time.perf_counter() - t0:.1f} s")

    turn2 = turn1 + answer + fresh(args.followup)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    warm = llm.generate([{"prompt_token_ids": turn2}], one, use_tqdm=False)[0]
    warm_s = time.perf_counter() - t0
    say(f"turn 2: {len(turn2)} tokens, {warm.num_cached_tokens} from the cache, TTFT {warm_s * 1000:.0f} ms")
    t0 = time.perf_counter()
    cold = llm.generate([{"prompt_token_ids": fresh(len(turn2))}], one, use_tqdm=False)[0]
    cold_s = time.perf_counter() - t0
    assert cold.num_cached_tokens == 0
    say(f"cold prompt of {len(turn2)} tokens: TTFT {cold_s * 1000:.0f} ms")
    say(f"ratio: {warm_s / cold_s:.3f} (bar <= 0.10)")


def say(line: str) -> None:
    print(line, flush=True)  # each phase as it ends: a long run on a shared machine shows where it is


if __name__ == "__main__":
    main()
