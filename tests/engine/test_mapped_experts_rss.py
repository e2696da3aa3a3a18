"""A GGUF's routed experts kept mapped (--cpu-moe, ember.quant.mapped_experts) are never read whole: a child
process's resident set after load grows by a small part of the experts' bytes, and their pages come in as
steps choose experts. After a prompt that touches every expert, its peak is what `ember plan` predicts
(experts counted whole, at the file's bytes) within 10%. Measured in a fresh interpreter (as
tests/models/test_qwen4_cold_table.py and tests/engine/test_peak_rss.py measure)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from gguf import GGMLQuantizationType as T

from ember.config import EngineConfig
from ember.engine.planner import plan
from tests.models.tiny_moe_gguf import prompt, tiny_moe_gguf

pytestmark = pytest.mark.engine

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = r"""
import json, sys, torch
from ember import LLM, SamplingParams

def rss():
    with open("/proc/self/status") as f:
        keys = ("VmRSS", "VmHWM", "RssFile")
        return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in f) if k in keys}

flags, ids = json.loads(sys.argv[1]), json.loads(sys.argv[2])
torch.zeros(1)
before = rss()
llm = LLM(**flags)
loaded = rss()
llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
print(json.dumps({"before": before, "loaded": loaded, "after": rss(),
                  "mapped": llm.engine.parts.loaded.mapped_expert_bytes}))
"""


def run_child(flags: dict, ids: list[int]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(flags), json.dumps(ids)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_mapped_experts_are_resident_only_as_touched_and_planned(tmp_path):
    # 2 layers x 16 experts x 3 x 1024 x 2048 Q8_0: 214 MB of experts, ~10 MB of everything else; a router of
    # small weights, so that 500 tokens choose every expert
    path = tiny_moe_gguf(
        str(tmp_path / "big.gguf"), hidden=1024, moe_ffn=2048, experts=16, expert_types=(T.Q8_0,) * 3, fast=True,
        router_std=0.02,
    )  # fmt: skip
    flags = dict(
        model=path, cpu_moe=True, dtype="float32", executor="eager", max_model_len=1024, kv_cache_memory=0.02,
        max_num_seqs=2, num_threads=1, max_num_batched_tokens=512,
    )  # fmt: skip
    got = run_child(flags, prompt(500, 5))
    experts = got["mapped"]
    assert experts > 200e6
    # the pools, the rest of the weights and what a load maps (its libraries: 53 MB on an AVX2 EPYC, 65 MB on an
    # AVX-512 Xeon), no expert: a copy of the experts or a read of their pages would add their 214 MB
    at_load = got["loaded"]["VmRSS"] - got["before"]["VmRSS"]
    assert at_load < 0.4 * experts, (at_load, experts)
    assert got["loaded"]["RssFile"] - got["before"]["RssFile"] < 0.1 * experts  # no expert page read at load
    touched = got["after"]["RssFile"] - got["loaded"]["RssFile"]
    assert 0.9 * experts < touched < 1.1 * experts, (touched, experts)  # each chosen expert's file pages came in
    predicted = plan(EngineConfig(device="cpu", **flags))
    parts = {k: round(v / 2**20) for k, v in predicted.peak_rss_parts.items()}
    assert predicted.peak_rss_parts["mapped experts"] == experts
    peak = got["after"]["VmHWM"]
    assert abs(predicted.peak_rss_bytes / peak - 1) <= 0.10, (
        f"planned {predicted.peak_rss_bytes / 2**20:.0f} MiB {parts}, measured {peak / 2**20:.0f} MiB"
    )
