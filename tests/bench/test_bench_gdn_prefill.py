"""`ember bench gdn-prefill`: the fused C++ prefill recurrence against the torch chunked form, both on
the same inputs, with the difference between their outputs and final states in every row."""

from __future__ import annotations

import json

import pytest

from ember.entrypoints.cli import main
from ember.kernels import cpu_gated_delta_net

pytestmark = pytest.mark.skipif(not cpu_gated_delta_net.available(), reason="the C++ op needs AVX-512 or AVX2 + FMA")


def test_rows_time_both_ways_and_agree(tmp_path):
    md = tmp_path / "gdn.md"
    args = ["bench", "gdn-prefill", "--shapes", "qwen3.5-0.8b", "--prompt-lens", "70,130", "--runs", "2"]
    assert main(args + ["--output", str(md)]) == 0
    (data,) = [json.loads(p.read_text()) for p in tmp_path.glob("*.json")]
    rows = data["rows"]["qwen3.5-0.8b"]
    assert [r["tokens"] for r in rows] == [70, 130]  # lengths that are not multiples of the 64-token chunk
    for r in rows:
        assert [len(r["seconds"][w]) for w in ("fused", "chunked", "chunked_ftz")] == [2, 2, 2]
        assert min(min(times) for times in r["seconds"].values()) > 0
        assert r["max_abs_out_diff"] < 2e-2 and r["state_rel_diff"] < 1e-4  # bf16 outputs, fp32 states
    text = md.read_text()
    assert "| qwen3.5-0.8b (16, 16, 128, 128) | 130 |" in text


def test_unknown_shape_is_refused(tmp_path):
    args = ["bench", "gdn-prefill", "--shapes", "qwen9", "--output", str(tmp_path / "g.md")]
    assert main(args) == 2
