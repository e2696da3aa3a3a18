"""`ember bench serve` end to end on a tiny model: results files, sections and counts, never speed."""

from __future__ import annotations

import json
import random

import pytest

from ember.bench.lib import load
from ember.entrypoints.cli import main
from tests.server.live import start_server

TINY_SERVER = ["--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "0.01", "--max-model-len", "256"]
QUICK = ["--quiet-wait", "0", "--warmup-prompts", "0"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def live(tiny):
    server = start_server(tiny)
    yield server
    server.stop()


def _level(js: dict, i: int = 0) -> dict:
    return js["levels"][i]["median"]


def test_token_id_prompts_against_a_url(tmp_path, tiny, live):
    md = tmp_path / "serve.md"
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                live.url,
                "--tokenizer",
                tiny,
                "--num-prompts",
                "5",
                "--max-concurrency",
                "2",
                "--input-len",
                "16",
                "--output-len",
                "6",
                "--label",
                "tiny",
                "--output",
                str(md),
            ]
            + QUICK
        )
        == 0
    )
    text = md.read_text()
    assert text.count("<!-- ember-bench:serve:tiny:begin -->") == 1
    assert "ember bench serve --tokenizer" in text and "--max-concurrency 2" in text
    assert "- machine: " in text and "- server: " + live.url in text
    assert "| 2 | 5 / 0 | 80 / 30 |" in text  # concurrency, ok / failed, prompt / output tokens from usage
    assert "ordinary (non-special) tokens" in text

    js = json.loads((tmp_path / "serve-tiny.json").read_text())
    assert js["prompt_format"] == "ids" and js["endpoint"] == "completions" and js["bars"] == []
    lv = _level(js)
    assert (lv["completed"], lv["failed"]) == (5, 0)
    assert lv["prompt_tokens"] == 5 * 16 and lv["output_tokens"] == lv["expected_output_tokens"] == 5 * 6
    assert lv["usage_reported"]
    for dist in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_s"):
        d = lv[dist]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"]
    assert lv["e2e_s"]["p99"] * 1e3 >= lv["ttft_ms"]["p50"]
    assert lv["output_throughput"] > 0 and lv["total_throughput"] > lv["output_throughput"]
    run = js["levels"][0]["runs"][0]
    assert run["cpu"]["server"] is None  # a server of unknown pid: its CPU is in "others"
    live.wait_idle()


def test_chat_with_text_prompts_and_a_second_section(tmp_path, tiny, live):
    md = tmp_path / "serve.md"
    md.write_text("# mine\n\n<!-- ember-bench:serve:other:begin -->\nkept\n<!-- ember-bench:serve:other:end -->\n")
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                live.url + "/v1",
                "--endpoint",
                "chat",
                "--num-prompts",
                "4",
                "--max-concurrency",
                "2",
                "--input-len",
                "48",
                "--output-len",
                "5",
                "--output",
                str(md),
            ]
            + QUICK
        )
        == 0
    )
    text = md.read_text()
    assert "kept" in text and "<!-- ember-bench:serve:tiny-qwen3:begin -->" in text
    js = json.loads((tmp_path / "serve-tiny-qwen3.json").read_text())
    assert js["prompt_format"] == "text" and js["server"]["model"] == "tiny-qwen3"
    lv = _level(js)
    assert (lv["completed"], lv["failed"], lv["output_tokens"]) == (4, 0, 20)
    # text sized by the server's own token counts: near the target, chat template included
    assert 4 * 48 * 0.6 <= lv["prompt_tokens"] <= 4 * 48 * 1.4
    live.wait_idle()


def test_failed_requests_are_counted_not_fatal(tmp_path, tiny, live):
    md = tmp_path / "serve.md"
    # 250 prompt tokens + 20 > max_model_len 256: every request is answered 400
    assert (
        main(
            [
                "bench",
                "serve",
                "--url",
                live.url,
                "--tokenizer",
                tiny,
                "--num-prompts",
                "3",
                "--input-len",
                "250",
                "--output-len",
                "20",
                "--output",
                str(md),
            ]
            + QUICK
        )
        == 0
    )
    js = json.loads((tmp_path / "serve-tiny-qwen3.json").read_text())
    lv = _level(js)
    assert (lv["completed"], lv["failed"]) == (0, 3)
    assert any("HTTP 400" in e and "maximum context length" in e for e in lv["errors"])
    assert "Failed requests" in md.read_text()


@pytest.mark.engine
def test_launch_runs_the_sweep_and_the_offline_peer(tmp_path, tiny):
    md = tmp_path / "serve.md"
    assert (
        main(
            [
                "bench",
                "serve",
                "--launch",
                tiny,
                *TINY_SERVER,
                "--server-args=--no-warmup",
                "--concurrency-list",
                "2,8",
                "--num-prompts",
                "8",
                "--input-len",
                "12",
                "--output-len",
                "4",
                "--quiet-wait",
                "0",
                "--output",
                str(md),
            ]
        )
        == 0
    )
    js = json.loads((tmp_path / "serve-ember.json").read_text())
    assert [lv["max_concurrency"] for lv in js["levels"]] == [2, 8]
    for i in (0, 1):
        lv = _level(js, i)
        assert (lv["completed"], lv["failed"], lv["prompt_tokens"], lv["output_tokens"]) == (8, 0, 96, 32)
    off = js["offline"]["median"]
    assert off["output_tokens"] == 32 and off["prompt_tokens"] == 96 and off["output_throughput"] > 0
    assert js["engine"]["max_num_seqs"] == 8  # sized to the top concurrency when left unset
    assert "--max-num-seqs 8" in js["server"]["command"] and "--no-warmup" in js["server"]["command"]
    assert js["levels"][1]["runs"][0]["cpu"]["server"] is not None  # the launched server's own CPU use
    bars = {b["text"].split(" ")[0]: b for b in js["bars"]}
    assert set(bars) == {"server", "TTFT"}
    assert all(b["result"] in ("PASS", "FAIL") for b in bars.values())
    text = md.read_text()
    assert "| offline LLM.generate (max_num_seqs 8) |" in text and "| bar | measured | result |" in text
    assert "--server-args=--no-warmup" in text


def test_bad_flag_combinations(capsys):
    assert main(["bench", "serve"]) == 2
    assert "exactly one of --url" in capsys.readouterr().err
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--max-num-seqs", "4"]) == 2
    assert "only apply with --launch" in capsys.readouterr().err
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--endpoint", "chat", "--prompt-format", "ids"]) == 2
    assert "needs --endpoint completions" in capsys.readouterr().err


def test_percentiles_and_lengths():
    assert load.percentile([], 50) is None
    assert load.percentile([3.0], 99) == 3.0
    assert load.percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert load.percentile(list(map(float, range(101))), 90) == pytest.approx(90.0)
    assert load.lengths(3, 128, 0.0, random.Random(0)) == [128, 128, 128]
    drawn = load.lengths(200, 100, 0.5, random.Random(0))
    assert min(drawn) >= 50 and max(drawn) <= 150 and len(set(drawn)) > 20


@pytest.mark.engine
def test_launch_chat_sends_text_and_runs_the_offline_peer_on_ids(tmp_path, tiny):
    md = tmp_path / "serve.md"
    assert (
        main(
            [
                "bench",
                "serve",
                "--launch",
                tiny,
                *TINY_SERVER,
                "--server-args=--no-warmup",
                "--endpoint",
                "chat",
                "--max-concurrency",
                "2",
                "--num-prompts",
                "2",
                "--input-len",
                "40",
                "--output-len",
                "3",
                "--random-range-ratio",
                "0.5",
                "--label",
                "chat",
                "--output",
                str(md),
            ]
            + QUICK
        )
        == 0
    )
    js = json.loads((tmp_path / "serve-chat.json").read_text())
    assert js["prompt_format"] == "text" and js["endpoint"] == "chat"
    lv, off = _level(js), js["offline"]["median"]
    assert (lv["completed"], lv["failed"]) == (2, 0)
    assert lv["output_tokens"] == lv["expected_output_tokens"] == off["output_tokens"]  # same drawn lengths
    assert [b["text"].split(" ")[0] for b in js["bars"]] == ["server"]


def test_a_redone_measurement_keeps_the_lengths_and_draws_new_prompts():
    from types import SimpleNamespace

    from ember.bench.commands.serve import Workload

    args = SimpleNamespace(num_prompts=6, input_len=20, output_len=10, random_range_ratio=0.5, prompt_seed=0)
    work = Workload(args, load.Target("http://x"), list(range(100, 200)), use_ids=True)
    a, b, c = work.specs(7), work.specs(7, salt=1), work.specs(8)
    assert [len(s.prompt) for s in a] == [len(s.prompt) for s in b] and [s.output_len for s in a] == [
        s.output_len for s in b
    ]
    assert [s.prompt for s in a] != [s.prompt for s in b]
    assert [len(s.prompt) for s in a] != [len(s.prompt) for s in c]
    assert work.specs(7) == a  # seeded
