"""`ember bench tp` on a tiny random Qwen3 over 2 gloo ranks: the table, the JSON, the comm share."""

import json

import pytest

from ember.entrypoints.cli import main


@pytest.mark.engine
@pytest.mark.all_cores
def test_bench_tp_measures_tp1_and_tp2(tmp_path):
    md = tmp_path / "tp.md"
    assert (
        main(
            [
                "bench",
                "tp",
                "--shape",
                "tiny",
                "--runs",
                "1",
                "--decode-tokens",
                "4",
                "--prompt-len",
                "16",
                "--dtype",
                "float32",
                "--kv-cache-memory",
                "0.05",
                "--output",
                str(md),
            ]
        )
        == 0
    )
    data = json.loads(md.with_suffix(".json").read_text())
    one, two = data["rows"]
    assert (one["tp"], two["tp"]) == (1, 2)
    assert one["comm_ms_median"] == 0 and two["comm_ms_median"] > 0 and 0 < two["comm_share_median"] < 1
    assert all(r["decode_tok_s"][0] > 0 and r["prefill_tok_s"][0] > 0 for r in data["rows"])
    text = md.read_text()
    assert "<!-- ember-bench:tp:begin -->" in text and f"| 2 | {two['threads_per_rank']} |" in text
    assert data["command"].startswith("ember bench tp --shape tiny --sizes 1,2")
