"""`ember bench compare | matrix | readme-table` on the default model, tiny sizes, fake peers: files, rows, bars.

The peers are fakes (tests/bench/fake_peers.py) swapped in through compare.PEERS: CI has no
llama-cpp-python, and what is tested here is the plumbing, not anyone's speed.
"""

import json
import statistics
import sys

import pytest

from ember.bench.commands import compare, matrix, readme_table
from ember.config import cpu_has_avx512_bf16
from ember.entrypoints.cli import main
from ember.errors import ConfigError
from tests.bench import test_bench_cli

one_model_load = test_bench_cli.one_model_load  # fixture: the default model, loaded once per set of knobs

TINY = [
    "--runs",
    "1",
    "--quiet-wait",
    "0",
    "--decode-tokens",
    "4",
    "--num-prompts",
    "2",
    "--input-len-range",
    "4,8",
    "--output-len",
    "3",
    "--kv-cache-memory",
    "0.05",
    "--max-model-len",
    "512",
    "--in-process",
]


@pytest.fixture
def fake_peers(monkeypatch):
    monkeypatch.setitem(compare.PEERS, "llamacpp", "tests.bench.fake_peers:FakeLlamaCpp")
    monkeypatch.setitem(compare.PEERS, "hf", "tests.bench.fake_peers:FakeHF")


def test_compare_writes_rows_and_judges_the_bars(tmp_path, one_model_load, fake_peers):
    md = tmp_path / "cpu.md"
    assert main(["bench", "compare", *TINY, "--prompt-lens", "8,16", "--bandwidth-mib", "8", "--output", str(md)]) == 0
    text = md.read_text()
    assert text.count("<!-- ember-bench:compare:begin -->") == 1
    assert "| metric | ember | llama.cpp | transformers | ember / llama.cpp | ember / transformers |" in text
    for row in (
        "| batch-1 decode, 4 tokens (tok/s) |",
        "| batch-1 decode, 4 tokens with MTP (tok/s) |",
        "| TTFT, 8-token prompt (ms) |",
        "| TTFT, 16-token prompt (ms) |",
        "| peak RSS (MiB) |",
        "| offline throughput, 2 prompts x 4-8 in / 3 out (out tok/s) |",
        "Memory: read bandwidth",
    ):
        assert row in text, row
    assert "--input-len-range 4,8" in text and "--in-process" in text and "--peer llamacpp,hf" in text
    assert "--llamacpp-batch parallel" in text and "all prompts as parallel sequences through llama_decode" in text
    assert "--decode-prompt chat" in text and "a held-out chat request for decode" in text

    data = json.loads((tmp_path / "cpu-compare.json").read_text())
    assert list(data["sides"]) == ["ember", "ember+MTP", "llama.cpp", "transformers"]
    assert data["sides"]["ember+MTP"]["speculation"] == "mtp" and data["sides"]["ember"]["speculation"] == "none"
    assert data["sides"]["llama.cpp"]["batch_mode"] == "parallel"  # the fake echoes what the peer was built with
    # transformers runs in the dtype ember picks on this CPU (bf16 only where it has bf16 instructions)
    assert data["sides"]["transformers"]["dtype"] == ("bfloat16" if cpu_has_avx512_bf16() else "float32")
    decode = next(f for f in data["figures"] if f["key"] == "decode")
    assert set(decode["values"]) == {"ember", "ember+MTP", "llama.cpp", "transformers"}
    assert decode["values"]["llama.cpp"]["median"] == pytest.approx(1.0)
    ttft = next(f for f in data["figures"] if f["key"] == "ttft_16")
    assert "ember+MTP" not in ttft["values"]  # MTP is measured on decode only
    assert ttft["values"]["llama.cpp"]["runs"] == [60000.0]
    # the issue's four bars, each judged from the figures written beside it by the rule (ember.bench.lib.bar):
    # the side's runs over the peer's, round by round, their median held against the threshold. ember's
    # figures are timings on a busy machine (with MTP, 4 tokens that a back-off or a slow step can make
    # slower than the fake's 1 tok/s x 1.5), so a verdict is checked against the rule, not fixed in advance;
    # test_the_issue_bars_are_judged_on_round_by_round_ratios feeds the rule figures that fix each verdict
    assert {(b["figure"], b["side"], b["peer"], b["op"], b["threshold"]) for b in data["bars"]} == {
        ("decode", "ember", "llama.cpp", ">=", 1.0),
        ("decode", "ember+MTP", "llama.cpp", ">=", 1.5),
        ("ttft_16", "ember", "llama.cpp", "<=", 0.33),
        ("throughput", "ember", "transformers", ">=", 3.0),
    }
    values = {f["key"]: f["values"] for f in data["figures"]}
    for b in data["bars"]:
        side, peer = values[b["figure"]][b["side"]]["runs"], values[b["figure"]][b["peer"]]["runs"]
        assert len(side) == len(peer) == 1 and side[0] > 0  # --runs 1: one measured round per side
        ratio = statistics.median(s / p for s, p in zip(side, peer))
        assert b["measured"] == pytest.approx(ratio), b
        meets = ratio >= b["threshold"] if b["op"] == ">=" else ratio <= b["threshold"]
        assert b["result"] == ("PASS" if meets else "FAIL"), b
        assert f"| {b['text']} | {b['shown']} | **{b['result']}** |" in text  # the report shows the same verdict
    # the fake transformers claims 1e6 out tok/s: no run of ember reaches 3x that, whatever the machine's load
    assert next(b for b in data["bars"] if b["figure"] == "throughput")["result"] == "FAIL"
    assert data["rss_shared_process"] is True and data["peak_rss_mib"]["ember"] > 0
    bw = data["bandwidth"]
    assert bw["weight_bytes"] > 0 and bw["gbps"]["median"] > 0 and 0 < bw["percent"]["median"]

    # the README table comes from this JSON
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n## Benchmarks\n\nold words\n")
    assert main(["bench", "readme-table", "--json", str(tmp_path / "cpu-compare.json"), "--readme", str(readme)]) == 0
    assert "| batch-1 decode, 4 tokens with MTP (tok/s) |" in readme.read_text()


def test_without_peers_the_bars_say_not_measured(tmp_path, one_model_load):
    md = tmp_path / "cpu.md"
    assert (
        main(
            [
                "bench",
                "compare",
                *TINY,
                "--peer",
                "none",
                "--no-mtp",
                "--prompt-lens",
                "8",
                "--bandwidth-mib",
                "0",
                "--decode-prompt",
                "random",
                "--output",
                str(md),
            ]
        )
        == 0
    )
    assert "4 tokens after a 32-token random prompt" in md.read_text()
    data = json.loads((tmp_path / "cpu-compare.json").read_text())
    assert list(data["sides"]) == ["ember"] and data["bandwidth"] is None
    assert all(b["result"].startswith("n/a") for b in data["bars"])
    assert "--peer none " in data["command"] and data["command"].endswith(" --in-process --no-mtp")


def test_decode_prompts_are_held_out_chat_requests():
    """One per round, the same for every side and every rerun, through the model's chat template."""
    from ember.bench.lib.prompts import load_tokenizer
    from ember.default_model import default_model_path

    prompt = compare.chat_prompts(default_model_path())
    first, again, second = prompt(0), prompt(0), prompt(1)
    assert first == again and first != second
    tok, _ = load_tokenizer(default_model_path())
    text = tok.decode(first, skip_special_tokens=False)
    assert text.count("<|im_start|>user") == 1 and text.endswith("<|im_start|>assistant\n")


def test_matrix_rows(tmp_path, one_model_load):
    md = tmp_path / "cpu.md"
    rows = "everything off,+ packed GGUF weights"
    assert main(["bench", "matrix", *TINY, "--prompt-len", "16", "--configs", rows, "--output", str(md)]) == 0
    text = md.read_text()
    assert text.count("<!-- ember-bench:matrix:begin -->") == 1
    assert (
        "| everything off (quantization=none, int8_decode=False, int4_dense_copy=False, cpu_tiled_gemv=False, "
        "cpu_int8_activations=False, cpu_paged_attention=False, cpu_fused_elementwise=False, cpu_flash_attention=False, "
        "enable_chunked_prefill=False"
    ) in text
    assert "| + packed GGUF weights (quantization=auto" in text
    data = json.loads((tmp_path / "cpu-matrix.json").read_text())
    assert [r["name"] for r in data["rows"]] == rows.split(",")
    assert [f["key"] for f in data["figures"]] == ["ttft_16", "decode", "throughput"]
    assert all(f["values"][r]["median"] > 0 for f in data["figures"] for r in rows.split(","))
    assert set(data["peak_rss_mib"]) == set(rows.split(","))


def test_matrix_adds_the_compiled_row_only_when_the_flag_exists(monkeypatch):
    monkeypatch.setattr(matrix, "has_executor_flag", lambda: False)
    names = [n for n, _ in matrix.configs({})]
    assert names[0] == "everything off" and "+ MTP speculation" in names and "+ compiled executor" not in names
    monkeypatch.setattr(matrix, "has_executor_flag", lambda: True)
    rows = matrix.configs({"compilation_config": {"compile_sizes": [1]}})
    assert rows[0][1]["executor"] == "eager" and rows[0][1]["quantization"] == "none"
    assert rows[0][1]["compilation_config"] is None  # valid only with the compiled executor
    last_name, last = rows[-1]
    assert last_name == "+ compiled executor"
    assert last["executor"] == "compiled" and last["enable_mtp"] and last["enable_chunked_prefill"]
    assert last["quantization"] == "auto" and last["cpu_int8_activations"]  # everything on: packed weights
    assert last["compilation_config"] == {"compile_sizes": [1]}


@pytest.mark.slow
def test_a_side_in_its_own_process():
    from ember.bench.sides.worker import RemoteSide

    side = RemoteSide("tests.bench.fake_peers:FakeLlamaCpp", {"threads": 1}, threads=1)
    try:
        assert side.description == {"name": "fake llama.cpp", "threads": 1}
        assert len(side.decode([1, 2, 3], 5)) == 5 and side.ttft([1]) == 60.0
        assert side.batch([[1], [2]], 3)[1] == 6
        assert side.peak_rss_bytes() > 1 << 20 and not side.shared_process and side.pid == side.proc.pid
    finally:
        side.close()
    assert side.proc.returncode == 0
    with pytest.raises(ConfigError, match="cannot start"):  # a user error in the worker arrives as one here
        RemoteSide("tests.bench.fake_peers:broken_peer", {}, threads=1)


def test_missing_llama_cpp_python_says_how_to_install(monkeypatch, capsys):
    from ember.bench.peers.llamacpp import LlamaCppPeer

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    with pytest.raises(ConfigError, match=r"llama-cpp-python.*pip install.*compiles llama.cpp"):
        LlamaCppPeer("model.gguf", threads=1)
    # the command says so before it loads anything
    assert main(["bench", "compare", "--peer", "llamacpp", "--runs", "1"]) == 2
    assert "pip install 'llama-cpp-python" in capsys.readouterr().err


SYNTHETIC = {
    "command": "ember bench compare",
    "threads": 2,
    "runs": 3,
    "machine": {"cpu": "AMD EPYC", "date": "2026-11-30 04:00 UTC"},
    "sides": {"ember": {}, "ember+MTP": {}, "llama.cpp": {}, "transformers": {}},
    "figures": [
        {
            "key": "decode",
            "name": "batch-1 decode, 256 tokens",
            "unit": "tok/s",
            "higher_is_better": True,
            "values": {
                s: {"runs": r, "median": r[1], "min": min(r), "max": max(r)}
                for s, r in {
                    "ember": [90, 100, 110],
                    "ember+MTP": [140, 150, 160],
                    "llama.cpp": [100, 100, 100],
                    "transformers": [40, 50, 60],
                }.items()
            },
        },
    ],
    "peak_rss_mib": {"ember": 600.0, "llama.cpp": 300.0, "transformers": 1200.0},
    "bandwidth": {
        "weight_bytes": 100e6,
        "gbps": {"median": 40.0},
        "achieved_gbps": {"median": 10.0},
        "percent": {"median": 25.0},
    },
    "bars": [
        {"figure": "decode", "side": "ember", "peer": "llama.cpp", "op": ">=", "threshold": 1.0, "result": "PASS"},
        {"figure": "decode", "side": "ember+MTP", "peer": "llama.cpp", "op": ">=", "threshold": 1.5, "result": "PASS"},
    ],
}


def test_readme_table_rewrites_only_its_fenced_block():
    readme = (
        "# ember\n\n## Benchmarks\n\n<!-- ember-bench:readme-compare:begin -->\nold table\n"
        "<!-- ember-bench:readme-compare:end -->\n\n## After\n"
    )
    out = readme_table.rewrite(readme, SYNTHETIC)
    assert "old table" not in out and out.startswith("# ember\n\n## Benchmarks\n\n") and out.endswith("\n## After\n")
    assert "| benchmark | ember | llama.cpp | transformers | ember / llama.cpp | ember / transformers | bar |" in out
    assert (
        "| batch-1 decode, 256 tokens (tok/s) | 100.0 [90.0-110.0] | 100.0 [100.0-100.0] | 50.0 [40.0-60.0] | "
        "1.00x [0.90-1.10] | 2.00x [1.83-2.25] | PASS (bar: >= 1x llama.cpp) |"
    ) in out
    assert "| batch-1 decode, 256 tokens with MTP (tok/s) | 150.0 [140.0-160.0] | 100.0 [100.0-100.0] |" in out
    assert "| 1.50x [1.40-1.60] | 3.00x [2.67-3.50] | PASS (bar: >= 1.5x llama.cpp) |" in out
    assert "| peak RSS (MiB) | 600.0 | 300.0 | 1200 | 2.00x | 0.50x |  |" in out
    assert "25% of the 40.0 GB/s" in out
    assert readme_table.rewrite(out, SYNTHETIC) == out  # idempotent


def test_readme_has_the_generated_table_fence():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert text.count("<!-- ember-bench:readme-compare:begin -->") == 1


def test_kv_pool_fits_the_throughput_batch_in_the_engines_dtype():
    """Without --kv-cache-memory, ember's pool holds the 64 x 640-token batch the peers run: 1 GiB per
    2 bytes of a KV element (a fixed 1 GiB held 36 of the 64 sequences in float32)."""
    from ember.entrypoints.cli import build_parser

    def pool(*flags):
        args = build_parser().parse_args(["bench", "compare", *flags])
        return compare.ember_knobs(args, 64)[0]

    auto = pool()
    assert auto["max_num_seqs"] == 64
    assert auto["kv_cache_memory"] == 1.0  # a bf16 cache on every CPU (platform.resolve_kv_cache_dtype_name)
    assert pool("--dtype", "float32")["kv_cache_memory"] == 2.0
    assert pool("--dtype", "bfloat16")["kv_cache_memory"] == 1.0
    assert pool("--dtype", "bfloat16", "--kv-cache-dtype", "fp8")["kv_cache_memory"] == 0.5
    assert pool("--kv-cache-memory", "0.3")["kv_cache_memory"] == 0.3


@pytest.mark.engine
def test_baseline_checkout_is_measured_in_its_own_worker(tmp_path):
    """--baseline DIR: another checkout's ember (here this one's own source tree) as a side of its own,
    its worker importing ember from DIR, judged within 5% on decode and throughput."""
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    md = tmp_path / "cpu.md"
    worker = [a for a in TINY if a != "--in-process"]
    assert (
        main(
            [
                "bench",
                "compare",
                *worker,
                "--peer",
                "none",
                "--no-mtp",
                "--baseline",
                root,
                "--prompt-lens",
                "8",
                "--bandwidth-mib",
                "0",
                "--decode-prompt",
                "random",
                "--output",
                str(md),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "cpu-compare.json").read_text())
    assert list(data["sides"]) == ["ember", "ember baseline"] and root in data["sides"]["ember baseline"]["checkout"]
    assert f"--baseline {root}" in data["command"]
    bars = {b["figure"]: b for b in data["bars"] if b["peer"] == "ember baseline"}
    assert set(bars) == {"decode", "throughput"} and bars["decode"]["op"] == "within"
    assert bars["decode"]["measured"] > 0 and bars["throughput"]["result"] in ("PASS", "FAIL")
    assert "| metric | ember | ember baseline | ember / ember baseline |" in md.read_text()
    # a folder that is no checkout is refused before anything loads (exit code 2: a user error)
    assert main(["bench", "compare", *TINY, "--peer", "none", "--baseline", str(tmp_path)]) == 2


@pytest.mark.engine
def test_versus_measures_other_flags_of_this_checkout(tmp_path):
    """--versus FLAGS: the same checkout with other engine flags as a side of its own, in the same rounds;
    the command's batch-1 decode is judged at least theirs (within 5%)."""
    md = tmp_path / "cpu.md"
    assert (
        main(
            [
                "bench",
                "compare",
                *TINY,
                "--peer",
                "none",
                "--no-mtp",
                "--versus",
                "--executor eager --max-num-seqs 1",
                "--prompt-lens",
                "8",
                "--bandwidth-mib",
                "0",
                "--decode-prompt",
                "random",
                "--output",
                str(md),
            ]
        )
        == 0
    )
    data = json.loads((tmp_path / "cpu-compare.json").read_text())
    assert list(data["sides"]) == ["ember", "ember --versus"]
    assert data["sides"]["ember --versus"]["flags"] == "--executor eager --max-num-seqs 1"
    assert data["sides"]["ember --versus"]["max_num_seqs"] == 1 != data["sides"]["ember"]["max_num_seqs"]
    assert "--versus '--executor eager --max-num-seqs 1'" in data["command"]
    [bar] = data["bars"]
    assert bar["peer"] == "ember --versus" and bar["op"] == ">=" and bar["measured"] > 0


def test_the_issue_bars_are_judged_on_round_by_round_ratios():
    """compare.bars fed figures: every bar PASSes or FAILs by its own side's ratio to its peer, the median
    of the rounds' ratios (not the ratio of the medians), and reads n/a where a side was not measured."""

    def figure(key: str, runs: dict) -> dict:
        return {"key": key, "values": {side: {"runs": r} for side, r in runs.items()}}

    def verdicts(figures: list[dict]) -> dict:
        return {f"{b.on['figure']}/{b.on['side']}": b.result for b in compare.bars(figures, 16)}

    passing = [
        # ember: rounds' ratios 1.1, 1.0, 0.95 (median 1.0, on the bar); MTP: 1.6, 1.5, 1.5 (on its bar)
        figure("decode", {"ember": [110, 100, 95], "ember+MTP": [160, 150, 150], "llama.cpp": [100, 100, 100]}),
        figure("ttft_16", {"ember": [30.0], "llama.cpp": [100.0]}),
        figure("throughput", {"ember": [300.0], "transformers": [100.0]}),
    ]
    assert verdicts(passing) == {
        "decode/ember": "PASS",
        "decode/ember+MTP": "PASS",
        "ttft_16/ember": "PASS",
        "throughput/ember": "PASS",
    }
    failing = [
        # MTP: ratios 1.5, 1.2, 1.25 (median 1.25 < 1.5), though the ratio of the medians is 150 / 100 = 1.5
        figure("decode", {"ember": [99, 249, 79], "ember+MTP": [150, 300, 100], "llama.cpp": [100, 250, 80]}),
        figure("ttft_16", {"ember": [34.0], "llama.cpp": [100.0]}),
        figure("throughput", {"ember": [299.0], "transformers": [100.0]}),
    ]
    assert verdicts(failing) == {
        "decode/ember": "FAIL",
        "decode/ember+MTP": "FAIL",
        "ttft_16/ember": "FAIL",
        "throughput/ember": "FAIL",
    }
    decode_without_mtp = {k: v for k, v in passing[0]["values"].items() if k != "ember+MTP"}
    without_mtp = verdicts([{**passing[0], "values": decode_without_mtp}])
    assert without_mtp["decode/ember"] == "PASS" and without_mtp["decode/ember+MTP"].startswith("n/a")
    assert without_mtp["throughput/ember"].startswith("n/a")  # its figure was not measured at all


def test_within_bar():
    from ember.bench.lib.rounds import ratio_bar

    fig = {"key": "decode", "values": {"ember": {"runs": [1.0, 1.0, 1.0]}, "b": {"runs": [1.02, 0.98, 1.0]}}}
    assert ratio_bar("t", [fig], "decode", "ember", "b", "within", 0.05).result == "PASS"
    fig["values"]["b"]["runs"] = [1.2, 1.2, 1.2]
    assert ratio_bar("t", [fig], "decode", "ember", "b", "within", 0.05).result == "FAIL"
