"""A/B of one compiled decode step: the AOTInductor package against torch.compile's graph, same process.

Both executors are built for the default model at batch 1 with the same inductor options (freezing
off), on the same KV pool; the package is built for this process only (no graph identity, nothing
kept). Their calls are timed in alternating rounds of 300 (median per executor), on a step of
`--keys` cached keys. docs/tuning.md ("Compile caches") has the figures this printed.

    .venv/bin/python scripts/package_step_ab.py [--keys 300] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


class _NoCompiler:
    """Stands in for a BackgroundCompiler: the executors are warmed up here, in the foreground."""

    def submit(self, executor) -> None:
        pass


def main() -> None:
    from ember.config.engine_args import add_engine_args, engine_config_from_args
    from ember.engine.engine import LLMEngine
    from ember.engine.executor.compiled import CompiledExecutor
    from ember.engine.executor.decode_batch import warmup_inputs

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    add_engine_args(parser)
    args = parser.parse_args()
    args.executor, args.enable_mtp = "eager", False
    engine = LLMEngine(engine_config_from_args(args))
    runner = engine.parts.runner
    built = {}
    for name, ahead in (("package", True), ("torch.compile", False)):
        ex = CompiledExecutor(
            runner.model, runner.kv_caches, runner.block_size, 8192, [1], freezing=False, compiler=_NoCompiler()
        )
        ex.ahead_of_time = ahead
        t0 = time.perf_counter()
        ex.warmup()
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s", flush=True)
        built[name] = ex.ready[(1, 1)]
    width = -(-args.keys // runner.block_size) + 1
    x = warmup_inputs(1, 1, width, runner.kv_caches[0].device)
    x.block_tables[0] = torch.arange(1, width + 1)
    x.seq_lens[0], x.positions[0] = args.keys, args.keys - 1
    x.slot_mapping[0] = (
        runner.block_size * x.block_tables[0, (args.keys - 1) // runner.block_size]
        + (args.keys - 1) % runner.block_size
    )
    times = {name: [] for name in built}
    with torch.inference_mode():
        for _ in range(args.rounds):
            for name, call in built.items():
                t0 = time.perf_counter()
                for _ in range(300):
                    call(x, (), runner.kv_caches)
                times[name].append((time.perf_counter() - t0) / 300 * 1e3)
    for name, ms in times.items():
        print(
            f"{name}: {statistics.median(ms):.3f} ms a step (median of {args.rounds} rounds; "
            f"{', '.join(f'{t:.3f}' for t in ms)})"
        )


if __name__ == "__main__":
    main()
