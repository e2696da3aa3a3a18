"""Where the compiled step graphs persist between processes: torch's own compile caches, in a folder of ember's.

The compiled executor's graphs are torch.compile's (ember.engine.compiled_executor). torch keeps
what it builds in its on-disk caches: inductor's FX graph cache (the generated C++ and its built
library) and AOTAutograd's cache (the traced joint graph), both keyed by what the graph depends on
(the traced graph with its shapes and dtypes, inductor's options, the torch version, the compiler
and the CPU's ISA), so a model, shape or machine that differs misses and compiles anew. A restart
of the same engine finds them and skips inductor's work: the batch-1 decode graph of the default
model took 104 s cold and 7.5 s from these caches (dynamo still traces the forward: 3.8 s of it),
on 2 cores (docs/tuning.md, "Compile caches").

torch's default folder is /tmp/torchinductor_$USER, which a reboot or a tmp cleaner empties; ember
points torch at ~/.cache/ember/torch-compile ($XDG_CACHE_HOME honoured) instead, unless
TORCHINDUCTOR_CACHE_DIR already names one (a user's choice, or a benchmark's fresh folder).
`ember compile` (run by `make run`'s install) fills it for a model before its first server starts.
"""
from __future__ import annotations

import os

ENV = "TORCHINDUCTOR_CACHE_DIR"  # torch reads it at every cache access, so setting it before the first compile suffices


def default_compile_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "ember", "torch-compile")


def use_compile_cache() -> str:
    """Point torch's compile caches at ember's folder unless TORCHINDUCTOR_CACHE_DIR is set; the folder in use."""
    path = os.environ.get(ENV)
    if not path:
        path = os.environ[ENV] = default_compile_cache_dir()
    os.makedirs(path, exist_ok=True)
    return path
