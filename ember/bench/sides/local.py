"""A side built in this process from its factory path, and the peak memory a process reports."""

from __future__ import annotations

import importlib
import resource
import sys


def build(factory: str, kwargs: dict):
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)(**kwargs)


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark. On Linux it is VmHWM, its own memory's: getrusage's
    ru_maxrss carries over exec from the process that started it (a worker spawned by a 1 GiB driver
    reports at least 1 GiB), so it would floor every side at the benchmark driver's size."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # macOS: bytes; other Unixes: KiB
    return peak if sys.platform == "darwin" else peak * 1024


class LocalSide:
    """A side built in this process (--in-process): cheap to start, but its memory is not its own."""

    shared_process = True
    pid = None  # its CPU time is this process's own

    def __init__(self, factory: str, kwargs: dict):
        self.side = build(factory, kwargs)
        self.description = self.side.description
        self.weight_bytes = getattr(self.side, "weight_bytes", None)
        self.prompt_vocab = getattr(self.side, "prompt_vocab", None)
        self.decode, self.ttft, self.batch = self.side.decode, self.side.ttft, self.side.batch

    def call(self, method: str, *args):
        """Any other method of the side (e.g. EmberSide.op_split)."""
        return getattr(self.side, method)(*args)

    def peak_rss_bytes(self) -> int:
        return peak_rss_bytes()

    def close(self) -> None:
        self.side = None
