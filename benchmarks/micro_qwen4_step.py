"""One decode step of a random qwen4_exp, eager against the compiled executor, and the PLE row prefetch on
and off (ember/layers/ple_gather.py), warm and cold table (docs/tuning.md, "qwen4_exp decode steps in a graph").

The model: 4 layers (GDN, QSA, GDN + PLE, QSA), hidden 1024, 4 streams (low rank 32), 32 experts top 4
(intermediate 256) and a shared expert of 512, QSA budget 256 / ratio 4, PLE 8 heads of 64 with 100k-row
heads (a 205 MB float32 table left in the file, read by pread), vocab 32000; float32. A step's time is its
forward's (the executor's run: the model eagerly, the package compiled), the median of 16 decode steps after
300-token prompts (past QSA's dense threshold: the selection runs), then the median of 3 alternating rounds. Cold: the table's pages are dropped from
the page cache (posix_fadvise DONTNEED) before every step, so each row is a read from the disk.

    nice .venv/bin/python benchmarks/micro_qwen4_step.py              # 2 threads, batches 1 and 4
    THREADS=1 BATCHES="1" .venv/bin/python benchmarks/micro_qwen4_step.py
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ember import LLM, SamplingParams  # noqa: E402
from ember.layers import ple_gather  # noqa: E402
from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4  # noqa: E402

THREADS = int(os.environ.get("THREADS", 2))
BATCHES = [int(b) for b in os.environ.get("BATCHES", "1 4").split()]
STEPS = 16
SHAPE = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    num_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
    hc_lowrank=32,
    heads_per_ngram=4,
    ple_embed_dim=512,
    ngram_vocab_size_base=100_000,
    indexer_n_heads=4,
    indexer_head_dim=64,
    indexer_budget=256,
)
KW = dict(dtype="float32", max_model_len=1024, kv_cache_memory=0.25, max_num_seqs=4, num_threads=THREADS)


def table_files(llm) -> list[tuple[int, int, int]]:
    """(fd, offset, bytes) of every file-backed shard of the model's PLE tables."""
    out = []
    for m in llm.engine.parts.runner.model.modules():
        for shard in getattr(getattr(m, "table", None), "shards", []):
            if getattr(shard, "path", None):
                out.append((shard._fd, shard.offset, shard.nbytes))
    return out


@contextlib.contextmanager
def table_mode(llm, prefetch: bool, cold: bool):
    """The PLE gather as asked: prefetched or read by the layer itself (take), the table's pages dropped
    first (cold) right before whichever reads them."""
    drop = table_files(llm) if cold else []
    real_start, real_take = ple_gather.start, ple_gather.take

    def dropped():
        for fd, offset, size in drop:
            os.posix_fadvise(fd, offset, size, os.POSIX_FADV_DONTNEED)

    def start(*args):
        if prefetch:
            dropped()
            real_start(*args)

    def take(*args):
        if not prefetch:
            dropped()
        return real_take(*args)

    ple_gather.start, ple_gather.take = start, take
    try:
        yield
    finally:
        ple_gather.start, ple_gather.take = real_start, real_take


def timed(llm) -> list[float]:
    """Wrap the engine's executor so that every decode step's forward (all query lengths 1) appends its
    seconds to the returned list."""
    ex, times = llm.engine.parts.runner.executor, []
    run = ex.run

    def timed_run(input_ids, positions, meta, *args):
        t0 = time.perf_counter()
        out = run(input_ids, positions, meta, *args)
        if meta.max_query_len == 1:
            times.append(time.perf_counter() - t0)
        return out

    ex.run = timed_run
    return times


def step_seconds(llm, times: list[float], batch: int) -> float:
    """The median forward of the decode steps of `batch` 300-token prompts, STEPS tokens each."""
    prompts = [{"prompt_token_ids": prompt(300, 7 + i)} for i in range(batch)]
    times.clear()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1 + STEPS, ignore_eos=True), use_tqdm=False)
    return statistics.median(times)


def main() -> None:
    path = save_qwen4(build_qwen4(**SHAPE), tempfile.mkdtemp(prefix="qwen4-step-"))
    cc = {"compile_sizes": BATCHES, "mode": "max-autotune-no-cudagraphs", "freezing": False}
    engines = {
        "eager": LLM(path, executor="eager", **KW),
        "compiled": LLM(path, executor="compiled", compilation_config=cc, **KW),
    }
    print(f"threads {THREADS}; packages {engines['compiled'].engine.parts.runner.executor.package_shapes}")
    step_times = {name: timed(llm) for name, llm in engines.items()}
    modes = [(batch, cold, prefetch) for batch in BATCHES for cold in (False, True) for prefetch in (True, False)]
    rows: dict[tuple, list[float]] = {}
    for _ in range(3):
        for batch, cold, prefetch in modes:
            for name, llm in engines.items():
                with table_mode(llm, prefetch, cold):
                    seconds = step_seconds(llm, step_times[name], batch)
                    rows.setdefault((batch, cold, prefetch, name), []).append(seconds)
    print("| batch | table | prefetch | eager ms/step | compiled ms/step | compiled / eager |")
    print("|---|---|---|---|---|---|")
    for batch, cold, prefetch in modes:
        e = statistics.median(rows[(batch, cold, prefetch, "eager")]) * 1e3
        c = statistics.median(rows[(batch, cold, prefetch, "compiled")]) * 1e3
        table = "cold" if cold else "warm"
        print(f"| {batch} | {table} | {'on' if prefetch else 'off'} | {e:.2f} | {c:.2f} | {c / e:.2f} |")


if __name__ == "__main__":
    main()
