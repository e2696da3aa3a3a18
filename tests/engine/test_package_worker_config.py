"""A package worker's engine (ember.engine.startup.package_worker.worker_config): its parent's configuration
with a KV pool of what a build touches, so that the worker does not hold a second serving pool; its graphs'
identity (and so its packages' paths) stays the parent's. A worker whose expected peak does not fit in the
memory available is not started: its shapes run eagerly, and nothing is compiled in the serving process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from ember.config import EngineConfig
from ember.engine.executor.compile_cache import graph_identity
from ember.engine.planner import GiB, KVPool, cpu_kv_budget_bytes
from ember.engine.startup.package_worker import PackageWorkers, worker_config


def test_worker_pool_holds_one_long_sequence_and_keeps_the_graph_identity(tmp_path):
    parent = EngineConfig(model=str(tmp_path), kv_cache_memory=2.0, max_model_len=4096, max_num_seqs=4)
    states = 0.25 * GiB  # 4 live slots and the default 8 snapshots
    pool = KVPool(budget_bytes=2.0 * GiB - states, block_size=16, block_bytes=98304, num_blocks=16384)
    worker = worker_config(parent, "cpu", pool, max_model_len=4096, max_num_seqs=4)
    blocks = 4096 // 16 + 4 + 1
    # the live slots' states, then its blocks; no snapshots
    assert cpu_kv_budget_bytes(worker) == states * 4 / 12 + blocks * pool.block_bytes
    assert worker.max_state_snapshots == 0
    assert graph_identity(worker, str(tmp_path)) == graph_identity(parent, str(tmp_path))
    assert worker.max_model_len == parent.max_model_len and worker.max_num_seqs == parent.max_num_seqs


def test_a_pool_already_as_small_and_cuda_keep_the_parents_configuration(tmp_path):
    parent = EngineConfig(model=str(tmp_path), kv_cache_memory=0.01)
    pool = KVPool(budget_bytes=0.005 * GiB, block_size=16, block_bytes=1 << 20, num_blocks=5)
    assert worker_config(parent, "cpu", pool, max_model_len=4096, max_num_seqs=4) is parent
    assert worker_config(parent, "cuda", pool, max_model_len=16, max_num_seqs=1) is parent


def test_a_build_that_would_not_fit_starts_no_worker_and_says_how_to_build_it(caplog, monkeypatch):
    import ember.platform

    monkeypatch.setattr(ember.platform, "available_ram_bytes", lambda: 3 << 30)
    started = []
    monkeypatch.setattr("ember.engine.startup.package_worker.PackageWorker", lambda *a, **k: started.append(a))
    with caplog.at_level(logging.WARNING, logger="ember"):
        assert not PackageWorkers(None, peak_bytes=4 << 30).build("compiled executor", [(1, 1)])
    assert not started
    assert "4096 MiB" in caplog.text and "3072 MiB are available" in caplog.text and "`ember compile`" in caplog.text


NO_ROOM = textwrap.dedent("""
    import json, sys
    import ember.platform
    ember.platform.available_ram_bytes = lambda: 1 << 20  # 1 MiB: no package build fits
    from torch._dynamo.utils import counters
    from ember import LLM, SamplingParams
    from ember.engine.executor import aot_package
    def built_here(*args, **kwargs):
        raise AssertionError("a package was built in the serving process")
    aot_package.build = built_here
    llm = LLM(model=sys.argv[1], executor="auto", max_num_seqs=2, compilation_config=json.loads(sys.argv[2]))
    llm.wait_for_compile(timeout=600)
    out = llm.generate(["hello"], SamplingParams(max_tokens=4, ignore_eos=True))
    executor = llm.engine.parts.runner.executor
    print(json.dumps({"ready": len(executor.ready), "steps": executor.compiled_steps, "tokens": len(out[0].outputs[0].token_ids),
                      "inductor": dict(counters["inductor"]), "dynamo": dict(counters["stats"])}))
    llm.close()
""")


@pytest.mark.engine
def test_no_room_for_a_build_serves_eagerly_and_compiles_nothing_here(tiny_model_dir, tmp_path):
    """A first start on a machine without the memory for a package build: no worker, no torch.compile in
    the serving process (its in-process fallback was removed), every step eager, and a warning that names
    `ember compile`."""
    env = dict(
        os.environ, EMBER_AUTO_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"), PYTHONPATH=os.getcwd()
    )
    cc = {"compile_sizes": [1, 2], "mode": "default", "cpp_wrapper": False, "freezing": False}
    run = subprocess.run(
        [sys.executable, "-c", NO_ROOM, tiny_model_dir("llama"), json.dumps(cc)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["ready"] == 0 and seen["steps"] == 0 and seen["tokens"] == 4
    assert not seen["inductor"] and not seen["dynamo"].get("unique_graphs")
    assert "are not built" in run.stderr and "`ember compile`" in run.stderr
    assert "exited with" not in run.stderr  # no worker was started to fail
