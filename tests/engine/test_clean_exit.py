"""A script that uses `LLM()` and ends while a background compile is in flight exits with status 0,
quietly: the compile is cancelled and joined before the interpreter tears down (a thread still
compiling then ended the process in SIGABRT, "terminate called without an active exception", in one
of two runs on a Zen3), and every file it wrote is under ember's compile cache, none in inductor's
shared temp folder."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

SCRIPT = """
from ember import LLM, SamplingParams
llm = LLM()
out = llm.generate(["Name the capital of France."], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
print(out[0].outputs[0].text)
"""

WITH_CLOSE = """
import time
from ember import LLM, SamplingParams
with LLM() as llm:
    llm.generate(["Hi"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    time.sleep(6)  # the package worker is building now
    t0 = time.monotonic()
print(f"closed in {time.monotonic() - t0:.1f} s")
"""


def _run_cold(tmp_path, script: str, i: int) -> subprocess.CompletedProcess:
    """`script` in a fresh interpreter with an empty compile cache and a temp folder of its own."""
    cache, tmp = tmp_path / f"cache{i}", tmp_path / f"tmp{i}"
    cache.mkdir()
    tmp.mkdir()
    env = dict(os.environ, XDG_CACHE_HOME=str(cache), TMPDIR=str(tmp), EMBER_AUTO_COMPILE="1")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.engine
def test_a_script_ending_mid_compile_exits_zero_five_times_in_five(tmp_path):
    for i in range(5):
        run = _run_cold(tmp_path, SCRIPT, i)
        assert run.returncode == 0, f"run {i}: exit {run.returncode}\n{run.stderr[-3000:]}"
        assert run.stdout.strip(), "no answer printed"
        for word in ("worker", "terminate called", "Traceback", "torch.compile builds it"):
            assert word not in run.stderr, f"run {i} said {word!r}:\n{run.stderr[-3000:]}"
        # nothing of inductor's under the temp folder: every compile wrote under ember's cache
        assert not glob.glob(str(tmp_path / f"tmp{i}" / "torchinductor_*")), os.listdir(tmp_path / f"tmp{i}")


@pytest.mark.engine
def test_close_cancels_a_running_compile_and_returns_quickly(tmp_path):
    run = _run_cold(tmp_path, WITH_CLOSE, 0)
    assert run.returncode == 0, run.stderr[-3000:]
    seconds = float(run.stdout.split("closed in ")[1].split()[0])
    assert seconds < 30, run.stdout
    assert "worker" not in run.stderr and "Traceback" not in run.stderr, run.stderr[-3000:]


@pytest.mark.engine
def test_an_engine_kept_after_its_llm_is_collected_still_serves_grammars():
    """The LLM's finalizer shuts its engine down when the wrapper is collected; an engine kept by itself
    (`LLM(...).engine`) still compiles grammars and answers."""
    import gc

    from ember import LLM, SamplingParams, StructuredOutputsParams

    engine = LLM(kv_cache_memory=0.05, max_model_len=512, enable_mtp=False, executor="eager").engine
    gc.collect()
    choice = StructuredOutputsParams(choice=["yes", "no"])
    rid = engine.add_request(None, "Is the sky blue?", SamplingParams(max_tokens=4, structured_outputs=choice))
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert outs and outs[-1].outputs[0].text in ("yes", "no")
