"""Where the compiled step graphs persist between processes: a folder of ember's, for torch's caches and ember's packages.

The compiled executor's graphs (ember.engine.executor.compiled) are AOTInductor packages for
quantized models (ember.engine.executor.aot_package, in `ember-aot/` here: ~5 ms to load a graph) and
torch.compile's for dense ones. torch keeps what torch.compile builds in its on-disk caches:
inductor's FX graph cache (the generated C++ and its built library) and AOTAutograd's cache (the
traced joint graph), both keyed by what the graph depends on (the traced graph with its shapes and
dtypes, inductor's options, the torch version, the compiler and the CPU's ISA), so a model, shape or
machine that differs misses and compiles anew. A restart of the same engine finds them and skips
inductor's work, not dynamo's: the batch-1 decode graph of the default model took 104 s cold and
7.5 s from these caches (dynamo's trace 3.8 s of it), on 2 cores (docs/tuning.md, "Compile caches").

torch's default folder is /tmp/torchinductor_$USER, which a reboot or a tmp cleaner empties and every
process of the user shares; ember points torch at ~/.cache/ember/torch-compile ($XDG_CACHE_HOME
honoured; torch-compile-avx2 under EMBER_CPU_ISA=avx2, whose graphs call other kernel builds) instead,
unless TORCHINDUCTOR_CACHE_DIR already names one (a user's choice, or a benchmark's fresh folder). torch
writes its own default into that variable the first time anything in the process asks for its cache
folder (a torch.compile before the engine starts, or another engine's test): that value is not a
choice, and ember replaces it.
`ember compile` (run by `make run`'s install) fills it for a model before its first server starts.
"""

from __future__ import annotations

import os
import sys

ENV = "TORCHINDUCTOR_CACHE_DIR"  # torch reads it at every cache access, so setting it before the first compile suffices


def default_compile_cache_dir() -> str:
    from ember.platform import isa_cap

    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    cap = isa_cap()
    return os.path.join(base, "ember", "torch-compile" if cap == "native" else f"torch-compile-{cap}")


def _torchs_default() -> str | None:
    """The folder torch falls back to (and writes into TORCHINDUCTOR_CACHE_DIR once it has used it);
    None where torch's inductor was never imported here, so could not have written it (importing it
    only to ask would cost an eager engine ~100 MiB of RSS)."""
    module = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    default = getattr(module, "default_cache_dir", None)
    return os.path.abspath(default()) if default is not None else None


def use_compile_cache() -> str:
    """Point torch's compile caches at ember's folder unless TORCHINDUCTOR_CACHE_DIR names another than
    torch's own default; the folder in use."""
    path = os.environ.get(ENV)
    if not path or os.path.abspath(path) == _torchs_default():
        path = os.environ[ENV] = default_compile_cache_dir()
    os.makedirs(path, exist_ok=True)
    return path


# -- which torch.compile graphs this machine has built (a package's own file says so for packages) --
# torch keys its caches on the traced graph, so it can only say whether a graph is cached after
# dynamo has traced it again. An engine decides before that whether to load its smallest batch
# size's graphs before it serves (seconds, when they are cached) or to serve at once and compile in
# the background (minutes, when they are not): a marker per built (executor, size) says which. It
# is a hint, never the graphs: a marker whose graphs were evicted costs a compile in the foreground.

# EngineConfig flags that change no traced graph (pool sizes, scheduling, sampling-side options; the
# compile options are named resolved, and the batch sizes by their shapes)
NOT_IN_GRAPHS = frozenset(
    {
        "seed",
        "kv_cache_memory",
        "gpu_memory_utilization",
        "enable_prefix_caching",
        "max_state_snapshots",
        "max_num_batched_tokens",
        "max_num_seqs",
        "enable_chunked_prefill",
        "compilation_config",
        "cuda_graph_max_batch_size",
        "max_logprobs",
        "reasoning_parser",
        "structured_outputs_config",
        "tokenizer",
    }
)


def graph_identity(config, model_path: str) -> str:
    """What an engine's compiled graphs depend on, in ember's terms: the model's file (or folder) as it
    is on disk, and the engine flags that change what is traced."""
    import dataclasses
    import json

    flags = {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(config)
        if f.metadata.get("group") and f.name not in NOT_IN_GRAPHS
    }
    path = os.path.realpath(str(model_path))
    try:
        st = os.stat(path)
        stamp = [st.st_size, st.st_mtime_ns]
    except OSError:
        stamp = None
    return json.dumps({"model": path, "stamp": stamp, "flags": flags}, sort_keys=True, default=str)


def built_marker(identity: str, what: str, size: int, shapes: list, options: dict) -> str:
    """Where the marker of one executor's batch size lives (the torch version and CPU are in its name)."""
    import hashlib
    import json

    import torch

    from ember.platform import cpu_flags_line

    key = json.dumps(
        [identity, what, size, sorted(shapes), options, torch.__version__, cpu_flags_line()],
        sort_keys=True,
        default=str,
    )
    return os.path.join(use_compile_cache(), "ember-built", hashlib.sha256(key.encode()).hexdigest()[:32])


def mark_built(marker: str) -> None:
    os.makedirs(os.path.dirname(marker), exist_ok=True)
    with open(marker, "w") as f:
        f.write("built\n")
