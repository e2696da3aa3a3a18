"""Building ember's C++ CPU kernels with torch.utils.cpp_extension (g++ and ninja).

Each kernel is built once per machine, the first time an engine needs it, then loaded from
torch's extension dir: on 2 Zen4 cores ~8-12 s each, the paged attention kernel's two units ~45 s.
The kernels include ATen's core headers, not torch/extension.h (pybind11 and the whole C++ API:
~20 s of parsing per unit; all four cold builds took 241 s with it, 72 s without). The build
name carries a hash of the CPU's flags and of the sources, since the code is compiled with
-march=native and a changed source must not load an old build. Builds in several processes at
once (a test suite's server subprocesses) are serialised by an flock on the build dir, which the
kernel releases when its holder dies: torch's own lock file outlives a process killed mid-build,
and every later build would wait on it forever. Where a build fails (no compiler, no ninja), the
caller gets None, a warning says why, and the torch path runs instead.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import time
from typing import Callable

import torch

from ember.platform import cpu_flags_line, has_cpu_flags  # noqa: F401 -- has_cpu_flags: the kernels' import

logger = logging.getLogger("ember")

_built: dict[str, object] = {}  # source path -> module (or True for an op library), None if it failed


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the pip package's binary sits in the venv, which a plain
    `.venv/bin/python` does not put on PATH."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def build_name(source: str, more_sources: tuple[str, ...] = ()) -> str:
    """The extension's name: the source's, tagged with a hash of the CPU's flags, the sources and
    the headers beside them (a changed header must not load an old build)."""
    here = os.path.dirname(__file__)
    digest = hashlib.sha1(cpu_flags_line().encode())
    for name in [source, *more_sources] + sorted(n for n in os.listdir(here) if n.endswith(".h")):
        with open(os.path.join(here, name), "rb") as f:
            digest.update(f.read())
    return f"ember_{os.path.splitext(source)[0]}_{digest.hexdigest()[:8]}"


def _build_directory(name: str) -> str:
    """Where torch's load() builds `name` by itself (so an earlier build is found): its own rule."""
    from torch.utils.cpp_extension import _get_build_directory

    return _get_build_directory(name, verbose=False)


@contextlib.contextmanager
def _exclusive_build(build_dir: str):
    """Hold an flock on build_dir; under it, a torch `lock` file left there is stale (its builder
    held this flock too, and died) and is removed, so torch's wait on it cannot hang."""
    with open(os.path.join(build_dir, "ember.flock"), "w") as f:  # closing it releases the flock
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = os.path.join(build_dir, "lock")
        if os.path.exists(stale):
            logger.warning("ember: removing a stale build lock %s (a build was killed midway)", stale)
            os.remove(stale)
        yield


def build(source: str, what: str, python_module: bool = True, fakes: dict[str, Callable] | None = None,
          more_sources: tuple[str, ...] = ()):
    """Compile and load `source` (a .cpp beside this file, linked with `more_sources`, which ninja
    compiles at the same time): its pybind module, or True once its TORCH_LIBRARY ops are
    registered (python_module=False), with `fakes` (op name -> fake kernel, the shapes
    torch.compile traces with) registered for them. None where it cannot be built."""
    if source in _built:
        return _built[source]
    here = os.path.dirname(__file__)
    result = None
    try:
        from torch.utils.cpp_extension import load

        _put_ninja_on_path()
        t0 = time.perf_counter()
        name = build_name(source, more_sources)
        build_dir = _build_directory(name)
        with _exclusive_build(build_dir):
            module = load(name=name, sources=[os.path.join(here, s) for s in (source, *more_sources)],
                          extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"],
                          is_python_module=python_module, verbose=False, build_directory=build_dir)
        result = module if python_module else True
        for op, fake in (fakes or {}).items():
            torch.library.register_fake(op)(fake)
        if time.perf_counter() - t0 > 2:
            logger.info("ember: built the C++ %s in %.0f s (cached for later runs)", what, time.perf_counter() - t0)
    except Exception as e:  # no compiler, no ninja, a build error: the torch path still works
        logger.warning("ember: the C++ %s could not be built (%s: %s); using the slower torch path. "
                       "Install g++ and ninja (pip install ninja) to get it", what, type(e).__name__, str(e)[:300])
    _built[source] = result
    return result
