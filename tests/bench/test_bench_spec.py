"""`ember bench spec` end to end on the default model and its MTP head, tiny sizes: files, rows, bars."""

import json

import pytest

from ember.bench.commands import spec as bench_spec
from ember.entrypoints.cli import main
from ember.errors import DefaultModelMissingError


@pytest.mark.engine
def test_bench_spec_writes_rows_acceptance_and_bars(tmp_path):
    from ember.default_model import default_model_path, default_mtp_path

    try:
        default_model_path()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))
    assert default_mtp_path() is not None
    md = tmp_path / "spec.md"
    assert (
        main(
            [
                "bench",
                "spec",
                "--peer",
                "none",
                "--runs",
                "1",
                "--quiet-wait",
                "0",
                "--num-prompts",
                "1",
                "--max-tokens",
                "12",
                "--ks",
                "1",
                "--temperatures",
                "0,0.8",
                "--output",
                str(md),
            ]
        )
        == 0
    )
    data = json.loads(md.with_suffix(".json").read_text())
    rows = {(r["config"], r["temperature"]) for r in data["rows"]}
    assert rows == {(c, t) for c in ("no speculation", "k=1", "adaptive, k<=1") for t in (0.0, 0.8)}
    k1 = next(r for r in data["rows"] if r["config"] == "k=1" and r["temperature"] == 0.0)
    assert len(k1["acceptance_per_pos"]) == 1 and 1.0 <= k1["mean_accepted_length"] <= 2.0
    assert k1["tok_s_median"] > 0 and k1["vs_no_spec"] > 0
    assert [b["text"].split(" (")[0] for b in data["bars"]] == [
        "position-1 acceptance >= 0.6 at temperature 0",
        "decode >= 1.6x no speculation at temperature 0",
        "decode >= 1.25x no speculation at temperature 0.8",
    ]
    text = md.read_text()
    assert "<!-- ember-bench:spec:begin -->" in text and "| 0 | k=1 |" in text and "mtp (" in text


class FakePeer:
    """Stands in for llama.cpp: 10 ms per token after the first."""

    def decode(self, prompt, n, temperature=0.0, seed=0):
        return [0.01 * i for i in range(n)]


def test_summary_ratios_and_bars_from_measured_rates():
    sides = [
        bench_spec.Side("no speculation", None),
        bench_spec.Side("k=2", 2),
        bench_spec.Side("llama.cpp", None, is_peer=True),
    ]
    sides[2].llm = FakePeer()
    counters = {
        "spec_num_drafts": 10,
        "spec_num_accepted_tokens": 12,
        "spec_num_accepted_tokens_per_pos": [7, 5],
        "spec_num_draft_tokens_per_pos": [10, 7],
        "spec_draft_seconds": 1.0,
        "spec_verify_seconds": 3.0,
    }
    for s, rate in zip(sides, (50.0, 90.0, 100.0)):
        s.rates[0.0], s.others[0.0], s.tokens[0.0] = [rate, rate + 2, rate - 2], [0.0, None, 0.1], 100
    sides[1].stats[0.0] = counters
    out = bench_spec.summarize(sides, [0.0])
    k2 = next(r for r in out["rows"] if r["config"] == "k=2")
    assert k2["vs_no_spec"] == pytest.approx(1.8) and k2["vs_llama_cpp"] == pytest.approx(0.9)
    assert k2["acceptance_per_pos"] == [0.7, 5 / 7] and k2["mean_accepted_length"] == pytest.approx(2.2)
    assert k2["draft_time_share"] == pytest.approx(0.25)
    assert [(b.measured, b.result) for b in out["bars"]] == [(0.7, "PASS"), (pytest.approx(1.8), "PASS")]
