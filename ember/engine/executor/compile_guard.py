"""The compile guard: a small process that ends an engine's compile processes if the engine dies.

inductor runs compilers (cc1plus) and compile workers as children of the engine process. An engine
that exits normally ends them itself (BackgroundCompiler.close); one that is SIGKILLed cannot, and
a compiler it started would run on, orphaned. While a background compile runs, this guard watches
the engine: every POLL_S it notes the engine's compile descendants, and when the engine is gone it
ends the ones it noted (and what they started), then exits. It also exits when the engine ends it
(the compile finished) or when it sees no engine.

    python -m ember.engine.executor.compile_guard ENGINE_PID
"""

from __future__ import annotations

import sys
import time

POLL_S = 0.25
WORKERS = ("compile_worker", "package_worker")
COMPILERS = {"cc", "c++", "g++", "gcc", "cc1plus", "clang", "clang++", "as", "ld", "collect2"}


def is_compile_process(proc) -> bool:
    """A compiler, one of inductor's compile workers (python -m torch._inductor.compile_worker ...) or one
    of ember's package workers (python -m ember.entrypoints.package_worker ...)."""
    import psutil

    try:
        return proc.name() in COMPILERS or any(w in part for part in proc.cmdline() for w in WORKERS)
    except psutil.Error:
        return False


def compile_descendants(proc) -> list:
    """proc's compile processes (its children that compile, and everything under them)."""
    import psutil

    found = []
    try:
        children = proc.children()
    except psutil.Error:
        return found
    for child in children:
        if is_compile_process(child):
            found.append(child)
            try:
                found += child.children(recursive=True)
            except psutil.Error:
                pass
    return found


def end(procs: list, timeout: float = 3.0) -> None:
    """terminate, then kill what is left after `timeout` seconds."""
    import psutil

    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


def is_alive(proc) -> bool:
    """Running and not a zombie; a process reaped between the two questions is not alive (it raises)."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str]) -> int:
    import psutil

    try:
        engine = psutil.Process(int(argv[0]))
    except (psutil.Error, IndexError, ValueError):
        return 0
    noted: dict[int, psutil.Process] = {}
    while is_alive(engine):
        for proc in compile_descendants(engine):
            noted.setdefault(proc.pid, proc)  # psutil.Process remembers its start time: no pid reuse
        time.sleep(POLL_S)
    # the engine is gone: its noted compile processes and whatever they started since
    procs = [p for p in noted.values() if p.is_running()]
    for proc in list(procs):
        try:
            procs += proc.children(recursive=True)
        except psutil.Error:
            pass
    end(procs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
