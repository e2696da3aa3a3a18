"""A package worker's process: `python -m ember.entrypoints.package_worker PARENT_PID CONFIG_FILE JOB [JOB ...]`.

It starts the engine its parent runs (the pickled EngineConfig in CONFIG_FILE), builds the
AOTInductor package of each JOB ("what|batch size|query length") into the compile cache, and exits.
Why packages are built in a process of their own, and the parent's side: ember.engine.startup.package_worker.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys

from ember.errors import EmberError


def build_packages(engine, jobs: list[str]) -> None:
    """Build each job's package with this process's engine (a worker, or `ember compile` itself)."""
    executors = {e.what: e for e in engine.parts.compiler.executors}
    for job in jobs:
        what, b, n = job.split("|")
        if what not in executors:
            raise EmberError(f"package job {job!r}: this engine has no executor {what!r}")
        executors[what].build_package((int(b), int(n)))


def _end_with_parent(parent: int) -> None:
    """SIGTERM this worker when the process that started it dies, however it dies (Linux's
    parent-death signal; elsewhere the worker finishes its jobs and exits)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        sys.exit(1)


def _release_drafter_pages(engine) -> None:
    """A drafter's weights (an MTP head, a draft model) are loaded by the speculator after the model; as
    the model's are (ember.loader.shapes_only), they are given back once loaded: nothing here serves."""
    import torch

    from ember.engine.startup.weights import builds_packages_only
    from ember.loader.shapes_only import release_module_pages

    spec = engine.parts.spec
    if spec is None or not builds_packages_only(engine.parts.config):
        return
    for value in vars(spec.proposer).values():
        if isinstance(value, torch.nn.Module):
            release_module_pages(value)
        elif isinstance(getattr(value, "model", None), torch.nn.Module):  # a LoadedModel
            release_module_pages(value.model)


def main(argv: list[str]) -> None:
    parent, config_file, *jobs = argv
    _end_with_parent(int(parent))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    with open(config_file, "rb") as f:
        config = pickle.load(f)
    from ember.engine.engine import LLMEngine  # the engine's start-up imports torch: only in the worker

    engine = LLMEngine(config, defer_compile=True)
    _release_drafter_pages(engine)
    from ember.engine.startup.package_worker import GUEST_THREADS

    if os.environ.get(GUEST_THREADS):  # beside a serving engine: export and lowering are single-threaded work
        import torch

        torch.set_num_threads(int(os.environ[GUEST_THREADS]))
    try:
        if engine.parts.compiler is not None:
            build_packages(engine, jobs)
        elif engine.parts.limits.executor == "compiled":
            # --executor compiled: the engine's start compiled every shape in the foreground, in this process
            # (a worker builds its packages itself), so the jobs' packages are built now; the parent loads them
            pass
        else:
            raise EmberError("the worker's engine compiles nothing (its configuration differs from its parent's)")
    finally:
        engine.shutdown()
        from ember.engine.startup.package_worker import write_peak_report

        write_peak_report()


if __name__ == "__main__":
    main(sys.argv[1:])
