"""--executor auto on CPU: the engine serves eagerly at once while a background thread compiles its
decode graphs (and the MTP fill's), then those steps run compiled; what auto resolves to; and a
process that ends mid-compile takes its compile workers and compilers with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ember import SamplingParams
from ember.config import EngineConfig
from ember.engine.executor.base import resolve_executor
from ember.engine.executor.compile_guard import COMPILERS, is_compile_process
from ember.engine.executor.compiled import CompiledExecutor
from ember.kernels.cpu_attention import CpuAttentionBackend
from ember.kernels.torch_attention import TorchAttentionBackend
from tests.engine.test_engine import make_llm
from tests.engine.test_step_executor import outputs
from tests.models.tiny_models import random_prompt
from tests.spec.test_mtp_spec import mtp_model  # noqa: F401  (fixture)

# default mode, no C++ wrapper: fastest to compile (the background path compiles what compiled does)
COMPILE = {"compile_sizes": [1, 2], "mode": "default", "freezing": True, "cpp_wrapper": False}


@pytest.fixture
def auto_compiles(monkeypatch):
    monkeypatch.setenv("EMBER_AUTO_COMPILE", "1")  # tests/conftest.py turns it off for the rest of the suite


def test_auto_resolves_to_compiled_only_where_it_is_the_fast_path(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("EMBER_AUTO_COMPILE", "1")
    assert resolve_executor(EngineConfig(), cpu, torch.float32, CpuAttentionBackend()) == "compiled"
    assert (
        resolve_executor(EngineConfig(), cpu, torch.float32, TorchAttentionBackend()) == "eager"
    )  # the reference stays plain
    assert (
        resolve_executor(EngineConfig(), cpu, torch.float8_e4m3fn, CpuAttentionBackend()) == "eager"
    )  # fp8 scales calibrate
    assert resolve_executor(EngineConfig(tensor_parallel_size=2), cpu, torch.float32, CpuAttentionBackend()) == "eager"
    assert resolve_executor(EngineConfig(enforce_eager=True), cpu, torch.float32, CpuAttentionBackend()) == "eager"
    monkeypatch.setenv("EMBER_AUTO_COMPILE", "0")
    assert resolve_executor(EngineConfig(), cpu, torch.float32, CpuAttentionBackend()) == "eager"


@pytest.mark.engine
@pytest.mark.usefixtures("auto_compiles")
def test_serves_eagerly_while_compiling_then_compiled_with_the_same_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    kw = dict(max_num_seqs=2, enable_prefix_caching=False)
    ref_llm = make_llm(path, executor="eager", **kw)
    llm = make_llm(path, compilation_config=COMPILE, **kw)
    engine, ex = llm.engine, llm.engine.parts.runner.executor
    compiler = engine.parts.compiler
    assert engine.parts.limits.executor == "compiled" and compiler is not None and ex.compiler is compiler
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    prompts = [random_prompt(n, 90 + s) for s, n in enumerate([6, 13])]
    ref = [o.token_ids for o in outputs(ref_llm, prompts, params)]
    # while the thread compiles: requests are answered (eagerly for any shape not published yet)
    assert [o.token_ids for o in outputs(llm, prompts, params)] == ref
    assert llm.wait_for_compile(timeout=600) and engine.executor_state == "compiled" and not compiler.failures
    assert sorted(ex.ready) == [(1, 1), (2, 1)] and all(fn is not None for fn in ex.ready.values())  # direct calls
    # the compile thread ended with its last job, and its OpenMP team with it: a team left alive made
    # libgomp's workers sleep between parallel regions, and compiled decode ran at 0.45x
    compile_threads = [t for t in threading.enumerate() if t.name == "ember-compile"]
    for t in compile_threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in compile_threads) and engine.parts.compiler._thread is None
    before = ex.compiled_steps
    for n in (1, 2):
        assert [o.token_ids for o in outputs(llm, prompts[:n], params)] == ref[:n]
    assert ex.compiled_steps - before >= 2 * 15  # every decode step after each first token
    # the compile never wrote the pool it serves from: the blocks are all free, and block 0 of every
    # layer holds only what requests wrote (compare with the eager engine, which ran the same requests)
    assert engine.parts.kv.num_free_blocks == engine.parts.kv.num_blocks
    engine.shutdown()


@pytest.mark.engine
@pytest.mark.usefixtures("auto_compiles")
def test_mtp_fill_compiles_after_the_model_and_adaptive_k_is_priced_then(mtp_model, monkeypatch):  # noqa: F811
    # scratch caches full of NaN, as reused heap memory can be (a fresh page is zeros): a verify step's
    # warmup reads slots its one writing row never wrote, and must not see them
    made = CompiledExecutor._scratch_caches

    def nan_garbage(self):
        with monkeypatch.context() as m:
            m.setattr(torch, "empty_like", lambda t: torch.full_like(t, float("nan")))
            return made(self)

    monkeypatch.setattr(CompiledExecutor, "_scratch_caches", nan_garbage)
    # an executor reads as timed only once its timings are there: the engine's thread prices adaptive k
    # the first time it reads `timed`, and a size settled before its timing priced it from nothing
    time_calls, timed_while_timing = CompiledExecutor._time_calls, []

    def recording(self, *args, **kwargs):
        timed_while_timing.append(self.timed)
        return time_calls(self, *args, **kwargs)

    monkeypatch.setattr(CompiledExecutor, "_time_calls", recording)
    path = mtp_model("qwen3", "deepseek")
    kw = dict(max_num_seqs=1, enable_mtp=True, num_speculative_tokens=2, adaptive_spec=True)
    prompt = [random_prompt(9, 71)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = outputs(make_llm(path, executor="eager", **kw), prompt, params)[0].token_ids
    llm = make_llm(path, compilation_config={**COMPILE, "compile_sizes": [1]}, **kw)
    assert outputs(llm, prompt, params)[0].token_ids == ref
    assert llm.wait_for_compile(timeout=600)
    spec = llm.engine.parts.spec
    ex, fill = llm.engine.parts.runner.executor, spec.proposer.fill_executor
    assert fill.compiler is ex.compiler and sorted(fill.ready) == sorted(ex.ready) == [(1, 1), (1, 2), (1, 3)]
    # the random head's record (no draft accepted) would start a new request with drafting off, and the
    # fill graphs would not run: a seeded request starts hopeful (spec/adaptive.py), greedy all the same
    seeded = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, seed=5)
    assert outputs(llm, prompt, seeded)[0].token_ids == ref
    assert fill.compiled_steps > 0 and ex.compiled_steps > 0
    # the first proposal after the compile read the graphs' timings
    assert timed_while_timing and not any(timed_while_timing)
    assert spec._unpriced is None and spec.adaptive.verify_costs == ex.verify_costs() and ex.verify_costs()


CHILD = textwrap.dedent("""
    import sys, time
    from tests.engine.test_engine import make_llm
    llm = make_llm(sys.argv[1], max_num_seqs=1, compilation_config={"compile_sizes": [1], "mode": "default"})
    print("serving", flush=True)
    time.sleep(600)
""")

# a compile job whose "compiler" is /bin/sleep under a compiler's name: it would outlive its engine by minutes
FAKE_CHILD = textwrap.dedent("""
    import subprocess, sys, time
    from ember.engine.executor.background_compile import BackgroundCompiler

    class Job:
        what, sizes, settled_sizes, ready = "fake", [1], set(), {}

        def built_sizes(self):
            return []

        def warmup(self, background, sizes):
            subprocess.run([sys.argv[1], "600"])

    BackgroundCompiler().submit(Job())
    print("compiling", flush=True)
    time.sleep(600)
""")


def _name(p) -> str | None:
    """A process's name, or None once it has exited (a compiler can end between listing and asking)."""
    import psutil

    try:
        return p.name()
    except psutil.Error:
        return None


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _compiles_or_runs_under_a_compiler(p) -> bool:
    """False for a process that exits while it is asked: inductor's compilers come and go by the
    dozen, and one gone between listing and asking (p.parents() raises then) is not left behind."""
    import psutil

    try:
        return is_compile_process(p) or any(is_compile_process(a) for a in p.parents())
    except psutil.Error:
        return False


def _compile_processes(pid: int) -> list:
    return [p for p in _descendants(pid) if _compiles_or_runs_under_a_compiler(p)]


def _guards_of(pid: int) -> list:
    import psutil

    return [
        p
        for p in psutil.process_iter(["cmdline"])
        if (p.info["cmdline"] or [])[-2:] == ["ember.engine.executor.compile_guard", str(pid)]
    ]


def _fake_compiler(tmp_path) -> str:
    import shutil

    path = tmp_path / "cc1plus"
    shutil.copy(shutil.which("sleep"), path)
    return str(path)


def test_a_process_gone_while_asked_is_neither_alive_nor_a_compiler():
    """The race both the guard and these tests meet: psutil listed a process that has exited by the time
    it is asked about (its name, parents or status then raise NoSuchProcess)."""
    import psutil

    from ember.engine.executor.compile_guard import is_alive

    class Gone:
        pid = 2**22 + 1  # above Linux's pid_max: no process has it

        def is_running(self):
            return True  # as it was a moment ago

        def __getattr__(self, what):  # name, cmdline, parents, status, ...
            def ask(*args, **kwargs):
                raise psutil.NoSuchProcess(self.pid)

            return ask

    assert not is_alive(Gone()) and not _compiles_or_runs_under_a_compiler(Gone())
    reaped = subprocess.Popen(["true"])
    proc = psutil.Process(reaped.pid)
    reaped.wait()
    assert not is_alive(proc) and not _compiles_or_runs_under_a_compiler(proc)


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
@pytest.mark.slow
def test_the_compile_guard_ends_a_dead_engines_compilers(tmp_path, how):
    """A plain script has no SIGTERM handler (no atexit runs), and SIGKILL allows none: the compile
    guard process ends the compilers the engine left, then itself."""
    import psutil

    child = subprocess.Popen(
        [sys.executable, "-c", FAKE_CHILD, _fake_compiler(tmp_path)],
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() == "compiling"
        deadline, compilers = time.time() + 60, []
        while time.time() < deadline and not compilers:
            compilers = [p for p in _descendants(child.pid) if _name(p) == "cc1plus"]
            time.sleep(0.1)
        assert compilers and _guards_of(child.pid)
        time.sleep(0.6)  # the guard has noted it (it polls every 0.25 s)
        child.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGKILL)
        child.wait(timeout=30)
        _, alive = psutil.wait_procs(compilers, timeout=10)
        assert not alive, "the compiler outlived its engine"
        deadline = time.time() + 10
        while _guards_of(child.pid) and time.time() < deadline:
            time.sleep(0.2)
        assert not _guards_of(child.pid)
    finally:
        for p in [child] if child.poll() is None else []:
            p.kill()
            p.wait()


def test_close_ends_a_running_compile_and_its_guard(tmp_path):
    """The engine's own exit (atexit, Ctrl-C, a served SIGTERM) closes the compiler: its compilers end now."""
    import psutil

    from ember.engine.executor.background_compile import BackgroundCompiler

    fake = _fake_compiler(tmp_path)

    class Job:
        what, sizes, settled_sizes, ready = "fake", [1], set(), {}

        def built_sizes(self):
            return []

        def cancel(self):
            pass

        def warmup(self, background, sizes):
            subprocess.run([fake, "600"])

    compiler = BackgroundCompiler()
    compiler.submit(Job())
    deadline, compilers = time.time() + 30, []
    while time.time() < deadline and not compilers:
        compilers = [p for p in _descendants(os.getpid()) if _name(p) == "cc1plus"]
        time.sleep(0.1)
    assert compilers and not compiler.done
    compiler.close()
    _, alive = psutil.wait_procs(compilers, timeout=5)
    assert not alive and compiler.wait(timeout=10) and not _guards_of(os.getpid())


@pytest.mark.engine
@pytest.mark.usefixtures("auto_compiles")
def test_a_real_compile_killed_midway_leaves_nothing_behind(tiny_model_dir, tmp_path):
    """The real thing: a cold inductor cache (its own folder) and the C++ wrapper; the engine is SIGKILLed
    while a compiler runs; nothing it started is left, and a fresh engine then compiles and serves."""
    import psutil

    env = dict(
        os.environ, EMBER_AUTO_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"), PYTHONPATH=os.getcwd()
    )
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, tiny_model_dir("llama")], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "serving"  # start-up did not wait for the compile
        deadline, seen = time.time() + 300, []
        while time.time() < deadline and not any(_name(p) in COMPILERS for p in seen):
            seen = _compile_processes(child.pid)
            time.sleep(0.1)
        assert seen, "no compiler appeared"
        child.kill()
        child.wait(timeout=60)
        _, alive = psutil.wait_procs(seen, timeout=20)
        assert not alive, [_name(p) for p in alive]
        deadline = time.time() + 15
        while _guards_of(child.pid) and time.time() < deadline:
            time.sleep(0.5)
        assert not _guards_of(child.pid)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
