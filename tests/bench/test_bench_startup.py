"""`ember bench startup`: real `ember serve` starts, cold (a fresh inductor cache) then warm, each timed to
/health 200, the first streamed token and the end of its background compile; the peer is refused
with what to do when llama-server is not there."""

from __future__ import annotations

import json

import pytest

from ember.entrypoints.cli import main


@pytest.mark.engine
def test_startup_times_cold_and_warm_starts(tiny_model_dir, tmp_path):
    md = tmp_path / "startup.md"
    args = [
        "bench",
        "startup",
        tiny_model_dir("llama"),
        "--peer",
        "none",
        "--runs",
        "1",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "0.05",
        "--compilation-config",
        '{"compile_sizes": [1], "mode": "default", "cpp_wrapper": false}',
        "--output",
        str(md),
        "--timeout",
        "600",
    ]
    assert main(args) == 0
    data = json.loads((tmp_path / "startup-startup.json").read_text())
    runs = data["runs"]["ember"]
    assert len(runs["cold"]) == 1 and len(runs["warm"]) == 1
    for r in runs["cold"] + runs["warm"]:
        assert 0 < r["health_s"] <= r["first_token_s"] and r["compiled_s"] >= r["health_s"]
    text = md.read_text()
    assert "| cold | /health 200 |" in text and "| warm | compiled |" in text


def test_missing_llama_server_is_refused_with_the_fix(tiny_model_dir, tmp_path):
    args = [
        "bench",
        "startup",
        tiny_model_dir("llama"),
        "--llama-server",
        str(tmp_path / "nope"),
        "--output",
        str(tmp_path / "s.md"),
    ]
    assert main(args) == 2
