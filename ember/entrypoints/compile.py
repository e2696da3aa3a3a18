"""`ember compile [MODEL] [engine flags]`: build a model's compiled step graphs now, so that servers start on them.

It starts the engine `ember serve` would start with the same flags and runs its background
compile to the end, in the foreground, with nothing else on the cores; AOTInductor packages (the
graphs of quantized models) are first built on every core, by this process and a package worker per
other core. What it builds lands in
torch's compile caches (ember.engine.executor.compile_cache), where every later engine of the same model,
flags, torch and CPU finds it: its graphs then load in seconds rather than minutes. `make run`'s
install runs it for the default model. A model or flag combination with nothing to compile (a
GPU, a hybrid model, --executor eager) says so and succeeds.
"""

from __future__ import annotations

import argparse
import os
import time

from ember.errors import EmberError
from ember.platform import usable_cores


def add_compile_parser(sub) -> None:
    from ember.config.engine_args import add_engine_args

    p = sub.add_parser(
        "compile",
        help="build a model's compiled decode graphs into the compile cache now "
        "(later `ember serve` starts load them in seconds)",
    )
    add_engine_args(p)
    p.set_defaults(func=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> None:
    from ember.config.engine_args import engine_config_from_args
    from ember.engine.engine import LLMEngine

    config = engine_config_from_args(args)
    t0 = time.monotonic()
    engine = LLMEngine(config, defer_compile=True)
    try:
        if engine.parts.compiler is None:
            print(
                f"ember compile: nothing to compile: this engine runs the {engine.parts.limits.executor} executor "
                "(graphs are compiled for --executor auto on CPU with ember's C++ kernels, where "
                "EMBER_AUTO_COMPILE is not 0)",
                flush=True,
            )
            return
        _build_packages_in_parallel(config, engine)
        engine.parts.compiler.demand = None  # nothing is served: every size compiles at once
        engine.start_compile()
        engine.wait_for_compile()
        failures = list(engine.parts.compiler.failures) + [
            f"{executor.what}: batch {b} x {n} has no package (see the log above)"
            for executor in engine.parts.compiler.executors
            for b, n in executor.shapes
            if (b, n) not in executor.ready
        ]
        shapes = engine.compiled_shapes
    finally:
        engine.shutdown()
    if failures:
        raise EmberError(
            "ember compile: these graphs did not compile (a server runs their steps eagerly): " + "; ".join(failures)
        )
    from ember.engine.executor.compile_cache import use_compile_cache

    print(
        f"ember compile: {shapes} decode graphs of {engine.parts.loaded.path} ready in "
        f"{time.monotonic() - t0:.0f} s, kept in {use_compile_cache()}",
        flush=True,
    )


def _packages_to_build(engine) -> list[str]:
    """The AOTInductor packages this engine's executors lack ("what|batch size|query length"), the
    model's before the MTP fill's."""
    from ember.engine.startup.package_worker import job_name

    jobs = []
    for executor in engine.parts.compiler.executors:  # the model's, then the MTP fill's
        if executor.ahead_of_time and executor.graph_identity is not None:
            jobs += [
                job_name(executor.what, shape)
                for shape in executor.shapes
                if not os.path.exists(executor.package_path(shape))
            ]
    return jobs


def _build_packages_in_parallel(config, engine) -> None:
    """Build the missing packages on every core: a package's build is mostly single-threaded (export
    and inductor's lowering in Python, then one g++ at a time). The packages are dealt round-robin
    into one share per core; this process builds the first, a package worker
    (ember.engine.startup.package_worker) each other one. The compile that follows loads what they
    built, and builds what a failed worker did not (docs/tuning.md, "Compile caches")."""
    from ember.engine.startup.package_worker import PackageWorker
    from ember.entrypoints.package_worker import build_packages

    jobs, cores = _packages_to_build(engine), usable_cores()
    shares = [jobs[i::cores] for i in range(min(len(jobs), cores))]
    if not shares:
        return
    workers = [PackageWorker(config, share) for share in shares[1:]]
    try:
        try:
            build_packages(engine, shares[0])
        except EmberError:
            pass  # built again by the compile that follows
        for worker in workers:
            worker.wait()
    finally:  # interrupted: the workers end with this command
        for worker in workers:
            worker.terminate()
