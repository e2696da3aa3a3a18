"""A/B (docs/tuning.md, Peak RSS): a hybrid's batch-1 decode package built with aten-only GEMMs vs inductor's default GEMM backends.
python benchmarks/ab_aot_gemm_backends.py FILE MODE(aten|default) -> prints decode tok/s (64 tokens, median of 3)"""

import os
import statistics
import sys
import tempfile
import time

os.environ["EMBER_PACKAGE_WORKER"] = "1"  # build in this process, so the patch below applies
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
    tempfile.gettempdir(), f"ember-ab-gemm-{sys.argv[2]}"
)  # a cache per mode
import torch  # noqa: E402 - after the environment above
import torch._inductor  # noqa: E402

real = torch._inductor.aoti_compile_and_package


def patched(program, package_path=None, inductor_configs=None, **kw):
    if sys.argv[2] == "default":
        inductor_configs = {k: v for k, v in inductor_configs.items() if k != "max_autotune_gemm_backends"}
    return real(program, package_path=package_path, inductor_configs=inductor_configs, **kw)


torch._inductor.aoti_compile_and_package = patched
from ember import LLM, SamplingParams  # noqa: E402

llm = LLM(
    model=sys.argv[1],
    max_model_len=4096,
    max_num_seqs=1,
    kv_cache_memory=0.3,
    executor="compiled",
    compilation_config={"compile_sizes": [1]},
)
ex = llm.engine.parts.runner.executor
prompt = {"prompt_token_ids": [(i * 37) % 150000 + 10 for i in range(64)]}
sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate([prompt], sp, use_tqdm=False)
rates = []
for _ in range(3):
    t0 = time.perf_counter()
    llm.generate([prompt], sp, use_tqdm=False)
    rates.append(64 / (time.perf_counter() - t0))
print(
    sys.argv[2],
    "packages",
    ex.package_shapes,
    "tok/s",
    [round(r, 2) for r in rates],
    "median",
    round(statistics.median(rates), 2),
    flush=True,
)
