"""TTFT of 2,000-token prompts on an `ember bench flash` file, then torch.profiler's op table of one more.

    python benchmarks/flash_prefill_profile.py ~/.cache/ember/bench/qwen3.8-flash-shape-random.q4_k_m.gguf

One sequence, 2 threads, no prefix cache (each prompt differs), the engine's own step loop. A development
profile of where a prefill chunk's time goes (docs/tuning.md); the bars' figures come from `ember bench flash`.
"""

import sys
import time

from torch.profiler import ProfilerActivity, profile

from ember import LLM, SamplingParams


def main(path: str) -> None:
    llm = LLM(
        model=path,
        max_num_seqs=1,
        num_threads=2,
        max_model_len=4096,
        kv_cache_memory=1.0,
        max_state_snapshots=0,
        enable_prefix_caching=False,
    )
    llm.wait_for_compile()
    engine = llm.engine

    def ttft(seed: int) -> float:
        prompt = [(i * 7919 + seed * 31) % 150000 + 100 for i in range(2000)]
        params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        engine.add_request(f"p{seed}", {"prompt_token_ids": prompt}, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    print("TTFT s", [round(ttft(seed), 2) for seed in range(3)])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        ttft(9)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))


if __name__ == "__main__":
    main(sys.argv[1])
