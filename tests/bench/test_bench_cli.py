"""`ember bench` end to end on the default model, tiny sizes, no peer: files and sections, not speed."""

import json

import pytest

from ember.bench.lib import files, metric
from ember.entrypoints.cli import main
from ember.errors import DefaultModelMissingError


@pytest.fixture
def one_model_load(monkeypatch):
    """Load the default model once for all three commands: loading dominates this test's time.
    Engines are keyed by their knobs, so each command still gets exactly the engine it asked for."""
    import ember.llm
    from ember.default_model import default_model_path

    try:
        default_model_path()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))
    real, cache = ember.llm.LLM, {}

    def cached(**knobs):
        key = repr(sorted(knobs.items()))
        if key not in cache:
            cache[key] = real(**knobs)
        return cache[key]

    monkeypatch.setattr(ember.llm, "LLM", cached)
    return cache


LATENCY = [
    "bench",
    "latency",
    "--peer",
    "none",
    "--runs",
    "1",
    "--quiet-wait",
    "0",
    "--prompt-lens",
    "16",
    "--max-num-seqs",
    "2",
]


def test_latency_and_throughput_share_one_markdown_file(tmp_path, one_model_load):
    md = tmp_path / "x.md"
    assert (
        main(
            [
                "bench",
                "throughput",
                "--peer",
                "none",
                "--runs",
                "1",
                "--quiet-wait",
                "0",
                "--num-prompts",
                "2",
                "--input-len",
                "8",
                "--output-len",
                "4",
                "--output",
                str(md),
            ]
        )
        == 0
    )
    assert main(LATENCY + ["--decode-tokens", "4", "--output", str(md)]) == 0

    text = md.read_text()
    assert text.count("<!-- ember-bench:throughput:begin -->") == 1
    assert text.count("<!-- ember-bench:latency:begin -->") == 1
    assert "ember bench throughput" in text and "--num-prompts 2" in text
    assert "ember bench latency" in text and "--prompt-lens 16" in text
    assert "| output throughput (tok/s) |" in text
    assert "| TTFT, 16-token prompt (ms) |" in text
    assert "n/a (no peer)" in text  # bars are listed but cannot be judged without a peer

    thr = json.loads((tmp_path / "x-throughput.json").read_text())
    lat = json.loads((tmp_path / "x-latency.json").read_text())
    assert thr["peer"] is None and thr["runs"] == 1
    assert thr["ember"]["max_num_seqs"] == 2  # the batch is sized to the workload
    out = next(m for m in thr["metrics"] if m["name"] == "output throughput")
    assert len(out["ember"]) == 1 and out["ember"][0] > 0 and out["peer"] is None
    names = [m["name"] for m in lat["metrics"]]
    assert names == [
        "batch-1 decode, 4 tokens, mean",
        "batch-1 decode, 4 tokens, steady (median gap)",
        "TTFT, 16-token prompt",
    ]
    assert all(m["ember_median"] > 0 for m in lat["metrics"])
    assert lat["machine"]["torch_threads"] >= 1 and lat["machine"]["cpu"]

    # a rerun rewrites only its own section
    before_throughput = text.split("<!-- ember-bench:latency:begin -->")[0]
    # new prompts: this process's engine has the first run's prompts in its prefix cache
    assert main(LATENCY + ["--decode-tokens", "3", "--prompt-seed", "1", "--output", str(md)]) == 0
    assert len(one_model_load) == 1  # throughput sized its batch to 2, latency asked for 2: one engine
    again = md.read_text()
    assert again.startswith(before_throughput)
    assert "batch-1 decode, 3 tokens" in again and "batch-1 decode, 4 tokens" not in again
    assert len(out["ember_others"]) == 1  # what other processes used is recorded per measurement


def test_update_markdown_replaces_only_its_section():
    text = files.update_markdown(files.HEADER, "a", "A1\n")
    text = files.update_markdown(text, "b", "B1\n")
    text = files.update_markdown(text, "a", "A2\n")
    assert "A1" not in text and "A2" in text and "B1" in text
    assert text.index("A2") < text.index("B1")  # replaced in place, not moved


def test_speedup_is_median_of_paired_runs():
    m = metric.Metric("t", "ms", higher_is_better=False, ember=[10.0, 20.0, 30.0], peer=[20.0, 20.0, 90.0])
    assert m.speedups == [2.0, 1.0, 3.0] and m.speedup == 2.0
    bar = metric.speedup_bar("no worse", [m], "t", 1.0)
    assert (bar.measured, bar.result) == (2.0, "PASS")
    bar = metric.speedup_bar("x", [m], "t", 2.5)
    assert (bar.measured, bar.result) == (2.0, "FAIL")


def test_contended_runs_are_left_out_unless_all_are():
    m = metric.Metric(
        "d",
        "tok/s",
        True,
        ember=[50.0, 5.0, 45.0],
        peer=[40.0, 10.0, 45.0],
        ember_others=[0.0, 1.3, 0.1],
        peer_others=[0.0, 0.2, 0.1],
    )
    assert m.kept_runs == [0, 2] and m.ember_median == 47.5 and m.speedup == pytest.approx((1.25 + 1.0) / 2)
    m.ember_others = [1.0, 1.3, 0.9]
    assert m.kept_runs == [0, 1, 2] and m.speedup == 1.0


def test_decode_rates_steady_ignores_a_stall():
    from ember.bench.lib.timing import decode_rates

    times = [0.0, 0.1, 0.2, 0.3, 1.3]  # four gaps, one stretched by someone else's job
    mean, steady = decode_rates(times)
    assert mean == pytest.approx(4 / 1.3) and steady == pytest.approx(10.0)


def test_decode_rates_share_a_steps_gap_among_its_tokens():
    from ember.bench.lib.timing import decode_rates

    times = [0.0, 0.1, 0.1, 0.2, 0.3, 0.3, 0.3, 0.4]  # speculative steps bring 2 and 3 tokens at once
    mean, steady = decode_rates(times)
    assert mean == pytest.approx(7 / 0.4) and steady == pytest.approx(20.0)  # gaps .05 .05 .1 .033 .033 .033 .1


def test_missing_transformers_says_how_to_fix(monkeypatch):
    import sys

    from ember.bench.peers.hf import HFPeer
    from ember.errors import ConfigError

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(ConfigError, match=r"pip install transformers accelerate.*--peer none"):
        HFPeer("model.gguf")


@pytest.mark.engine
def test_bench_structured_writes_both_bars(tmp_path):
    """`ember bench structured` on the default model, one short run: constrained and free decode at batch 1
    and 32 in one file, with the two bars judged (the figures themselves are benchmarks/structured.md's)."""
    import json as _json

    from ember.entrypoints.cli import main

    out = tmp_path / "structured.md"
    main(
        [
            "bench",
            "structured",
            "--runs",
            "1",
            "--output-len",
            "8",
            "--quiet-wait",
            "0",
            "--output",
            str(out),
            "--kv-cache-memory",
            "0.3",
            "--max-model-len",
            "512",
        ]
    )
    data = _json.loads((tmp_path / "structured-structured.json").read_text())
    assert [m["name"] for m in data["metrics"]] == ["batch-1 decode", "batch-32 decode"]
    assert all(m["ember"][0] > 0 and m["peer"][0] > 0 for m in data["metrics"])
    assert [b["threshold"] for b in data["bars"]] == [0.9, 0.85]
    assert "constrained batch-32 decode" in out.read_text()
