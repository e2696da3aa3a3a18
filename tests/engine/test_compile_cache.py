"""The compiled graphs persist across processes: `ember compile` builds them in one process, and an
engine started later in another loads them before it serves and runs its decode steps on them, with
nothing compiled anew. Quantized models (freezing off) keep AOTInductor packages; frozen (dense) ones
torch's own caches, in ember's folder. Plus the pieces around it: which folder, freezing's default, the
metric that says how many shapes run compiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from ember import LLM
from ember.engine.executor.compile_cache import default_compile_cache_dir, use_compile_cache
from ember.engine.executor.compiled import auto_freezing
from ember.server.metrics import ServerMetrics
from tests.engine.test_engine import make_llm
from tests.spec.test_spec_metrics import sample_value

# fastest to compile (mode default, no C++ wrapper for torch.compile's graphs)
COMPILE = {"compile_sizes": [1], "mode": "default", "cpp_wrapper": False}

LATER_START = textwrap.dedent("""
    import json, sys
    from torch._dynamo.utils import counters
    from ember import LLM, SamplingParams
    from ember.engine.executor import aot_package
    def built_here(*args, **kwargs):  # a missing package is built by a worker process, never by a serving one
        raise AssertionError("a package was built in the serving process")
    aot_package.build = built_here
    llm = LLM(model=sys.argv[1], executor="auto", max_num_seqs=int(sys.argv[3]), dtype="float32",
              compilation_config=json.loads(sys.argv[2]))
    at_start = llm.engine.compiled_shapes  # before any step: loaded while the engine was built
    assert llm.wait_for_compile(timeout=600)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = ["hello there", "the capital of France is"]
    served = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]  # batch 2: the worker's package
    same = None  # packages only (argv[4]): a guest worker's package, built on zero weights, serves eager's tokens
    if sys.argv[4] == "compare":
        eager = LLM(model=sys.argv[1], executor="eager", max_num_seqs=2, dtype="float32")  # bf16 greedy: near-ties differ
        same = served == [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    engine = llm.engine
    executor = engine.parts.runner.executor
    print(json.dumps({"same_as_eager": same, "at_start": at_start, "inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"]),
                      "shapes": engine.compiled_shapes, "steps": executor.compiled_steps,
                      "packages": executor.package_shapes,
                      "failures": engine.parts.compiler.failures, "cache": executor.cache_dir,
                      "worker_peak_rss": executor.package_workers.peak_rss_bytes}))
""")


def test_the_cache_folder_is_embers_unless_one_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "recorded, so that monkeypatch restores the variable")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("EMBER_CPU_ISA", raising=False)
    ours = str(tmp_path / "xdg" / "ember" / "torch-compile")
    assert default_compile_cache_dir() == ours
    assert use_compile_cache() == ours and os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours and os.path.isdir(ours)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache() == str(tmp_path / "mine")  # a user's (or a benchmark's) choice stands
    # torch writes its own default (/tmp/torchinductor_$USER) into the variable once anything asked for
    # its folder: not a choice, so ember's folder replaces it
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert cache_dir() == os.environ["TORCHINDUCTOR_CACHE_DIR"] != ours
    assert use_compile_cache() == ours and os.environ["TORCHINDUCTOR_CACHE_DIR"] == ours
    # an AVX2 run on this machine (EMBER_CPU_ISA=avx2) compiles against other kernel builds: its own folder
    monkeypatch.setenv("EMBER_CPU_ISA", "avx2")
    assert default_compile_cache_dir() == ours + "-avx2"


@pytest.mark.engine
def test_freezing_is_on_for_dense_weights_and_off_for_quantized_ones(tiny_model_dir):
    from ember.default_model import default_model_path

    assert auto_freezing(make_llm(tiny_model_dir("llama"), executor="eager").engine.parts.runner.model) is True
    quantized = LLM(default_model_path(), executor="eager", dtype="bfloat16", kv_cache_memory=0.05, max_model_len=128)
    assert auto_freezing(quantized.engine.parts.runner.model) is False


def test_metrics_say_how_many_shapes_run_compiled():
    class Engine:  # what watch_compile reads
        parts, compiled_shapes = SimpleNamespace(compiler=None), 3

    metrics = ServerMetrics("tiny")
    metrics.watch_compile(Engine())
    text = metrics.render().decode()
    assert sample_value(text, "ember:executor_compiled_shapes") == 3
    assert sample_value(text, "ember:executor_compiling") == 0


@pytest.mark.engine
@pytest.mark.parametrize("freezing", [False, True], ids=["package", "torch-caches"])
def test_ember_compile_fills_the_cache_that_a_later_process_loads(tiny_model_dir, tmp_path, freezing):
    """freezing off (as for the default, quantized model): an AOTInductor package per shape, loaded with
    no tracing and no inductor work. freezing on: torch's FX graph cache hits (AOTAutograd's cache
    refuses frozen graphs, so it traces again)."""
    model = tiny_model_dir("llama")
    env = dict(
        os.environ, EMBER_AUTO_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.getcwd()
    )
    cc = json.dumps(COMPILE | {"freezing": freezing, "compile_sizes": [1]})
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "ember.entrypoints.cli",
            "compile",
            model,
            "--max-num-seqs",
            "1",
            "--dtype",
            "float32",
            "--compilation-config",
            cc,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stderr[-2000:]
    assert "decode graphs of" in built.stdout and str(tmp_path / "cache") in built.stdout
    if not freezing:
        assert built.stderr.count("compiled ahead of time") == 1
        assert built.stderr.count("loaded from its ahead-of-time package") == 1  # the final compile loads it
    # packages: the later start also serves batch 2, which nobody built: a package worker builds it
    # while the engine serves (ember compile's workers, one per core, build a share of its packages)
    later_cc, later_seqs = (cc, "1") if freezing else (json.dumps(json.loads(cc) | {"compile_sizes": [1, 2]}), "2")
    later = subprocess.run(
        [sys.executable, "-c", LATER_START, model, later_cc, later_seqs, "skip" if freezing else "compare"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert later.returncode == 0, later.stderr[-2000:]
    seen = json.loads(later.stdout.strip().splitlines()[-1])
    assert seen["cache"] == str(tmp_path / "cache") and not seen["failures"]
    if freezing:
        assert seen["packages"] == []
        assert seen["inductor"].get("fxgraph_cache_hit", 0) >= 1 and not seen["inductor"].get("fxgraph_cache_miss")
        assert seen["shapes"] == 1 and seen["at_start"] == 1  # the size built before, loaded before serving
    else:
        assert seen["packages"] == [[1, 1], [2, 1]]  # batch 2 too, and this process's build() raises
        # batch 2's package came from a guest worker whose model was loaded for its shapes only
        # (ember.loader.shapes_only: its weights read zeros): on this model's weights it serves the eager tokens
        assert seen["same_as_eager"]
        assert 100 * 2**20 < seen["worker_peak_rss"] < 8 * 2**30  # the build's memory, measured and reported
        assert not seen["inductor"] and not seen["aot"]  # nothing traced or compiled in this process
        assert seen["shapes"] == 2 and seen["at_start"] == 1  # batch 1 loaded before serving
    assert seen["steps"] > 0  # batch-1 decode steps ran the loaded graph


@pytest.mark.slow
def test_larger_batch_sizes_wait_until_a_step_could_use_them(monkeypatch):
    """Batch 1 compiles at once; batch 2 waits while one request runs (its trace would slow that
    request's steps) and goes when two are in the engine; batch 4 then waits until four are, or the
    engine has been idle for a while."""
    import time

    from ember.engine.executor import background_compile
    from ember.engine.executor.background_compile import BackgroundCompiler

    monkeypatch.setattr(background_compile, "IDLE_BEFORE_LARGER_SIZES_S", 0.5)
    waiting = {"n": 1}
    compiled: list[int] = []

    class Job:
        what, sizes, settled_sizes, ready = "fake", [1, 2, 4], set(), {}

        def built_sizes(self):
            return []

        def warmup(self, background, sizes):
            compiled.extend(sizes)

    def settle(want: list[int]) -> None:
        deadline = time.time() + 10
        while compiled != want and time.time() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # long enough for a size that should wait to have gone, were it not waiting
        assert compiled == want

    compiler = BackgroundCompiler(demand=lambda: waiting["n"])
    compiler.submit(Job())
    settle([1])  # batch 2 waits: one request runs
    waiting["n"] = 2
    settle([1, 2])  # two run: batch 2 is wanted now; batch 4 is not
    waiting["n"] = 0
    assert compiler.wait(timeout=10) and compiled == [1, 2, 4]  # idle for a while: batch 4 compiles


def test_steps_take_one_thread_while_a_job_compiles():
    import torch

    from ember.engine.executor.background_compile import BackgroundCompiler

    before = torch.get_num_threads()
    compiler = BackgroundCompiler(paused=True)
    try:
        compiler._active.set()  # as while a job runs
        compiler.fit_step_threads()
        assert torch.get_num_threads() == 1
        compiler._active.clear()
        compiler.fit_step_threads()
        assert torch.get_num_threads() == compiler.step_threads == before
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_ember_compile_says_when_there_is_nothing_to_compile(tiny_model_dir):
    out = subprocess.run(
        [sys.executable, "-m", "ember.entrypoints.cli", "compile", tiny_model_dir("llama"), "--executor", "eager"],
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and "nothing to compile" in out.stdout and "eager" in out.stdout
