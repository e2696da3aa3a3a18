"""A CPU engine's peak RSS and speed across a workload, for one set of flags (docs/tuning.md, "The step
budget on CPU" and "A bf16 KV cache under float32 activations").

    [EMBER_CPU_ISA=avx2] python benchmarks/step_memory.py FILE|default '{"max_num_batched_tokens": 512}'

FILE with the hybrid bench's knobs (max_model_len 2048, max_num_seqs 4, --kv-cache-memory 0.127,
--max-state-snapshots 0, 2 threads), or `default` for the default model (--kv-cache-memory 0.5); the
JSON's flags override them. The engine built and its background compile waited for, then three 64-token
greedy decodes, prompts of 1000, 1000, 1000 and 2000 tokens (one token each: TTFT), and 16 prompts of
128-512 tokens in / 64 out. Prints VmHWM after each stage, the decode rates, the TTFTs and the throughput.
"""

from __future__ import annotations

import json
import random
import sys
import time


def hwm_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM"))


def main() -> None:
    import torch

    torch.set_num_threads(2)
    from ember import LLM, SamplingParams

    flags = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    if sys.argv[1] == "default":
        knobs = {"kv_cache_memory": 0.5}
    else:
        knobs = {"model": sys.argv[1], "max_model_len": 2048, "max_num_seqs": 4, "kv_cache_memory": 0.127}
        knobs["max_state_snapshots"] = 0
    llm = LLM(**(knobs | {"num_threads": 2} | flags))
    llm.wait_for_compile(timeout=1800)
    limits = llm.engine.parts.limits
    print(
        f"built: VmHWM {hwm_mib()} MiB; budget {limits.max_num_batched_tokens}, KV {limits.kv_dtype}, {limits.executor}"
    )
    rng = random.Random(0)

    def prompt(n: int) -> dict:
        return {"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(n)]}

    rates = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([prompt(32)], SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
        rates.append(64 / (time.perf_counter() - t))
    print("decode 64 tokens (tok/s):", [round(r, 1) for r in rates], f"VmHWM {hwm_mib()} MiB")
    for n in (1000, 1000, 1000, 2000):
        if n >= limits.max_model_len:
            continue
        t = time.perf_counter()
        llm.generate([prompt(n)], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        print(f"{n}-token prompt: TTFT {time.perf_counter() - t:.2f} s, VmHWM {hwm_mib()} MiB")
    batch = [prompt(rng.randrange(128, 512)) for _ in range(16)]
    t = time.perf_counter()
    llm.generate(batch, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
    print(f"16 prompts x 64 out: {16 * 64 / (time.perf_counter() - t):.1f} tok/s, VmHWM {hwm_mib()} MiB")
    llm.close()


if __name__ == "__main__":
    main()
