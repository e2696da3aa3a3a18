"""`ember compile [MODEL] [engine flags]`: build a model's compiled step graphs now, so that servers start on them.

It starts the engine `ember serve` would start with the same flags and runs its background
compile to the end, in the foreground, with nothing else on the cores. What it builds lands in
torch's compile caches (ember.engine.compile_cache), where every later engine of the same model,
flags, torch and CPU finds it: its graphs then load in seconds rather than minutes. `make run`'s
install runs it for the default model. A model or flag combination with nothing to compile (a
GPU, a hybrid model, --executor eager) says so and succeeds.
"""
from __future__ import annotations

import argparse
import time

from ember.errors import EmberError


def add_compile_parser(sub) -> None:
    from ember.engine_args import add_engine_args

    p = sub.add_parser("compile", help="build a model's compiled decode graphs into the compile cache now "
                                       "(later `ember serve` starts load them in seconds)")
    add_engine_args(p)
    p.set_defaults(func=cmd_compile)


def cmd_compile(args: argparse.Namespace) -> None:
    from ember.engine.engine import LLMEngine
    from ember.engine_args import engine_config_from_args

    config = engine_config_from_args(args)
    t0 = time.monotonic()
    engine = LLMEngine(config, defer_compile=True)
    try:
        if engine.compiler is None:
            print(f"ember compile: nothing to compile: this engine runs the {engine.executor_name} executor "
                  "(graphs are compiled for --executor auto on CPU with ember's C++ kernels, where "
                  "EMBER_AUTO_COMPILE is not 0)", flush=True)
            return
        engine.compiler.demand = None  # nothing is served: every size compiles at once
        engine.start_compile()
        engine.wait_for_compile()
        failures = list(engine.compiler.failures)
        shapes = engine.compiled_shapes
    finally:
        engine.shutdown()
    if failures:
        raise EmberError("ember compile: these graphs did not compile (a server runs their steps eagerly): "
                         + "; ".join(failures))
    from ember.engine.compile_cache import use_compile_cache

    print(f"ember compile: {shapes} decode graphs of {engine.loaded.path} ready in {time.monotonic() - t0:.0f} s, "
          f"kept in {use_compile_cache()}", flush=True)
