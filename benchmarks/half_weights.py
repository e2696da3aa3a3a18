"""A bf16 Hugging Face folder run in float32 on CPU: its matrices kept 16-bit (quant.half_weights, the
default) against widened to float32 at load (--no-cpu-half-weights), same process, alternating rounds:
batch-1 greedy decode of 63 tokens after a 16-token prompt (eager executor on both sides: the lever is
the bytes a step reads, not the graphs), and the weights as held.

    [EMBER_CPU_ISA=avx2] python benchmarks/half_weights.py FOLDER [ROUNDS]

Prints one JSON line: tok/s per round and their medians, MiB of weights.
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main() -> None:
    from ember import LLM, SamplingParams

    path, rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 3
    sides = {
        k: LLM(
            path,
            dtype="float32",
            executor="eager",
            max_model_len=512,
            kv_cache_memory=0.5,
            max_num_seqs=4,
            cpu_half_weights=k == "half",
        )
        for k in ("half", "float32")
    }
    prompt = [{"prompt_token_ids": list(range(100, 116))}]
    first, decode = (
        SamplingParams(temperature=0, max_tokens=1),
        SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
    )
    speeds: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(rounds):
        for k, llm in sides.items():
            t0 = time.perf_counter()
            llm.generate(prompt, first, use_tqdm=False)
            prefill = time.perf_counter() - t0
            t0 = time.perf_counter()
            llm.generate(prompt, decode, use_tqdm=False)
            speeds[k].append(63 / (time.perf_counter() - t0 - prefill))
    print(
        json.dumps(
            {
                "decode_tok_s": {k: [round(x, 2) for x in v] for k, v in speeds.items()},
                "median": {k: round(statistics.median(v), 2) for k, v in speeds.items()},
                "weights_mib": {k: round(llm.engine.parts.loaded.weight_bytes / 2**20) for k, llm in sides.items()},
            }
        )
    )
    for llm in sides.values():
        llm.close()


if __name__ == "__main__":
    main()
