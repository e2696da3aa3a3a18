"""qwen4_exp's n-gram table stays cold (issue 54): loaded from a checkpoint whose table is hundreds of MB,
the engine's resident set grows by a small part of the table, at load and after a long prompt, because the
table's shards stay in the file's mapping and only the rows a batch hashes to are read
(ember.loader.mapped_safetensors, ember.layers.ple.NGramTable). Measured in a child process, whose resident
set holds only what ember loaded; the same child checks the tokens against a twin whose table is resident."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4

pytestmark = pytest.mark.engine

# 4 heads x ~2.4M rows of 16 bf16 values: a 300 MB table (the model's other weights are ~1 MB)
BASE = 2_400_000
CHILD = r"""
import json, sys, torch
from ember import LLM, SamplingParams

def rss():
    with open("/proc/self/status") as f:
        return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in f) if k in ("VmRSS", "VmHWM")}

path, ids = sys.argv[1], json.loads(sys.argv[2])
torch.zeros(1)
before = rss()
llm = LLM(path, dtype="float32", executor="eager", max_model_len=2048, kv_cache_memory=0.05, max_num_seqs=2)
loaded = rss()
out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)[0].outputs[0].token_ids
after = rss()
mapped = llm.engine.parts.loaded.mapped_weight_bytes
print(json.dumps({"before": before, "loaded": loaded, "after": after, "mapped": mapped, "tokens": out}))
"""


def saved(tmp_path_factory, name: str, **overrides) -> tuple[str, int]:
    hf = build_qwen4(**overrides).to(torch.bfloat16)
    path = save_qwen4(hf, str(tmp_path_factory.mktemp(name)))
    return path, sum(p.numel() * p.element_size() for n, p in hf.named_parameters() if "ngram_embedding" in n)


def run_child(path: str, ids: list[int]) -> dict:
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, path, json.dumps(ids)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_table_is_read_by_row_not_resident(tmp_path_factory):
    """The same engine on a twin whose table is 1,000x smaller is the baseline: what the large table adds to
    the resident set is what its touched rows' pages hold."""
    big, table = saved(tmp_path_factory, "big-table", ngram_vocab_size_base=BASE)
    small, _ = saved(tmp_path_factory, "small-table")
    assert table > 250e6
    ids = prompt(1500, 7, eos_at=(100, 900))
    got, base = run_child(big, ids), run_child(small, ids)
    assert got["mapped"] == table  # the start-up line's "read by row" figure is the whole table
    at_load = (got["loaded"]["VmRSS"] - got["before"]["VmRSS"]) - (base["loaded"]["VmRSS"] - base["before"]["VmRSS"])
    peak = (got["after"]["VmHWM"] - got["before"]["VmRSS"]) - (base["after"]["VmHWM"] - base["before"]["VmRSS"])
    # a 1,500-token prompt hashes 4 rows a token: at most 6,000 pages of 4 KiB (24 MB) of the table come in
    assert at_load < 0.05 * table, (at_load, table)
    assert peak < 0.15 * table, (peak, table)
