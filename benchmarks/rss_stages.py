"""Where a CPU engine's resident memory goes, stage by stage (docs/tuning.md, "Peak RSS").

    python benchmarks/rss_stages.py FILE ['{"executor": "eager"}']

The bench's ember knobs (max_model_len 4096, max_num_seqs 16, --kv-cache-memory 1 GiB, 2 threads) plus
the JSON's engine flags (which override those): the engine built, its background compile waited for, then batches of 1, 2, 4,
8 and 16 short prompts decoded (12 tokens each, the compile waited for after each), then one prompt of 512,
1000 and 2000 tokens (those below max_model_len) prefilled. Prints VmRSS and
VmHWM after each stage, and whether dynamo and inductor were imported (an AOTInductor-packaged engine
never imports them).
"""

from __future__ import annotations

import json
import random
import sys
import time


def rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) // 1024
    return out


def main() -> None:
    t0 = time.time()

    def say(what: str) -> None:
        print(f"{time.time() - t0:7.1f}s {what:30s} {rss()}", flush=True)

    import torch

    torch.set_num_threads(2)
    from ember.llm import LLM
    from ember.sampling import SamplingParams

    say("imported")
    flags = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    llm = LLM(
        model=sys.argv[1],
        **({"max_model_len": 4096, "max_num_seqs": 16, "kv_cache_memory": 1.0, "num_threads": 2} | flags),
    )
    say("engine built")
    llm.wait_for_compile()
    say("compile waited")
    rng = random.Random(0)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for b in (1, 2, 4, 8, 16):
        prompts = [{"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(8)]} for _ in range(b)]
        llm.generate(prompts, params, use_tqdm=False)
        llm.wait_for_compile()
        say(f"batch {b} decoded")
    for n in (512, 1000, 2000):  # the benches' TTFT prompts: one prefill step of up to max_num_batched_tokens
        if n < llm.engine.config.max_model_len:
            prompt = {"prompt_token_ids": [rng.randrange(100, 5000) for _ in range(n)]}
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            say(f"{n}-token prompt")
    print(
        "dynamo imported:",
        "torch._dynamo" in sys.modules,
        "| inductor imported:",
        "torch._inductor.compile_fx" in sys.modules,
    )


if __name__ == "__main__":
    main()
