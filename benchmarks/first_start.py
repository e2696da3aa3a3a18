"""A first start of a model on a cold compile cache: how long the engine takes to serve, how long its
background build of the decode graphs (AOTInductor packages, in a package worker process) takes, and the
peak RSS of both processes against the weights' size (issue 53: "a first start on a new model stays a guest").

    [EMBER_CPU_ISA=avx2] TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) python benchmarks/first_start.py MODEL

TORCHINDUCTOR_CACHE_DIR names an empty folder: ember's compile cache then lives there, so nothing was
built before. Prints one JSON line.
"""

from __future__ import annotations

import json
import resource
import sys
import time


def main() -> None:
    t0 = time.time()
    from ember import LLM, SamplingParams

    llm = LLM(model=sys.argv[1], max_model_len=4096)
    started = time.time() - t0
    built = llm.wait_for_compile(timeout=3000)
    compiled = time.time() - t0
    llm.generate(["hello there"], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
    executor = llm.engine.parts.runner.executor
    print(
        json.dumps(
            {
                "serving_after_s": round(started, 1),
                "graphs_built_after_s": round(compiled, 1),
                "built": built,
                "packages": executor.package_shapes,
                "worker_peak_rss_mib": round(executor.package_workers.peak_rss_bytes / 2**20),
                "engine_peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                "weights_mib": round(llm.engine.parts.loaded.weight_bytes / 2**20),
            }
        )
    )
    llm.close()


if __name__ == "__main__":
    main()
