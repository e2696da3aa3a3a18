"""`ember bench hybrid`'s model files: a random Qwen3.5 folder written by transformers with the
default model's tokenizer, converted by llama.cpp's own converter (fetched from the llama-cpp-python
sdist) and quantized by llama.cpp's own quantizer, which ember loads and runs; a whole run over two of
the files at toy sizes, against the real llama.cpp (the test extra has llama-cpp-python), writes every
row, the per-op split and every bar; and the command's defaults."""

import argparse
import json
import re

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.commands import hybrid
from ember.bench.commands.hybrid import (
    QWEN35_08B,
    QWEN35_MOE_SMALL,
    add_cli_args,
    build_file,
    build_folder,
    build_gguf,
)
from ember.bench.lib import op_split
from ember.entrypoints.cli import main
from ember.kernels import cpu_gated_delta_net
from tests.models.tiny_models import one_thread  # noqa: F401

TINY = dict(
    QWEN35_08B,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    intermediate_size=96,
    vocab_size=152000,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_folder(str(tmp_path_factory.mktemp("hybrid") / "q35"), shape=TINY)


@pytest.mark.engine
def test_the_model_files_are_built_converted_quantized_and_run(folder):
    gguf = build_gguf(folder)
    from gguf import GGUFReader

    reader = GGUFReader(gguf)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen35"
    q8 = build_file(folder, "q8_0")
    assert q8.endswith(".q8_0.gguf") and {t.tensor_type.name for t in GGUFReader(q8).tensors} >= {"Q8_0", "F32"}
    llm = LLM(folder, dtype="float32", kv_cache_memory=0.01, max_model_len=128, num_threads=1)
    out = llm.generate(
        [{"prompt_token_ids": list(range(5, 40))}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )[0]
    assert len(out.outputs[0].token_ids) == 4 and torch.tensor(out.outputs[0].token_ids).lt(152000).all()
    assert build_folder(folder, shape=TINY) == folder and build_gguf(folder) == gguf  # built once
    assert build_file(folder, "q8_0") == q8


TOY = [
    "--runs",
    "1",
    "--quiet-wait",
    "0",
    "--decode-tokens",
    "4",
    "--prompt-lens",
    "16",
    "--num-prompts",
    "2",
    "--input-len-range",
    "4,8",
    "--output-len",
    "3",
    "--kv-cache-memory",
    "0.02",
    "--max-model-len",
    "128",
    "--bandwidth-mib",
    "8",
    "--split-steps",
    "2",
    "--in-process",
]
ROWS = (  # regular expressions of each file's rows
    r"batch-1 decode, 4 tokens \(tok/s\)",
    r"batch-1 decode, 4 tokens, steady \(median gap\) \(tok/s\)",
    r"TTFT, 16-token prompt \(ms\)",
    r"offline throughput, 2 prompts x 4-8 in / 3 out; llama\.cpp (parallel|sequential) \(out tok/s\)",
    r"peak RSS \(MiB\)",
    r"achieved read bandwidth \(% of measured\)",
)
BARS = (  # and of its bars
    r"batch-1 decode >= {x}x llama\.cpp",
    r"TTFT at 16 tokens <= 0\.5x llama\.cpp's",
    r"2-sequence throughput >= 2x llama\.cpp's best batched \((parallel|sequential)\)",
    r"peak RSS <= 1\.2x llama\.cpp's",
    r"GDN core \+ conv <= 10% of a decode step",
)


@pytest.mark.engine
@pytest.mark.usefixtures("one_thread")
def test_two_files_write_every_row_split_and_bar(folder, tmp_path):
    md = tmp_path / "hybrid.md"
    argv = ["bench", "hybrid", *TOY, "--model-dir", folder, "--files", "bf16,q8_0", "--output", str(md)]
    assert main(argv) == 0
    text = md.read_text()
    assert text.count("<!-- ember-bench:hybrid:begin -->") == 1
    assert "| file | metric | ember | llama.cpp | ember / llama.cpp |" in text
    assert "; 0 prefix-cache state snapshots (llama.cpp keeps none" in text  # like for like unless asked
    for name, kind in (("BF16", "bf16"), ("Q8_0", "q8_0")):
        for r in ROWS:  # the row, a value in every cell: ember's, llama.cpp's, their ratio
            assert re.search(rf"\| {name} \| {r} \| [0-9][^|]* \| [0-9][^|]* \| [0-9.]+x[^|]* \|", text), (name, r)
        assert re.search(rf"\| {name} \| [a-z-]+ \| [0-9.]+ \| [0-9.]+ \|( [0-9.]+ \([0-9]+%\) \|){{7}}", text), name
        assert re.search(rf"- {name}: read bandwidth [0-9.]+ .*ember reads .*llama.cpp reads ", text), name
        for bar in BARS:
            pattern = rf"\| {name}: {bar.format(x=hybrid.DECODE_BAR[kind])} \| [^|]+ \| \*\*(PASS|FAIL|n/a[^*]*)\*\* \|"
            assert re.search(pattern, text), (name, bar)
    data = json.loads((tmp_path / "hybrid-hybrid.json").read_text())
    assert list(data["files"]) == ["bf16", "q8_0"] and len(data["bars"]) == 10
    for d in data["files"].values():
        assert set(d["sides"]) == {"ember", "llama.cpp"} and d["llamacpp_batch"]["mode"] in hybrid.BATCH_MODES
        assert set(d["llamacpp_batch"]["warmup_out_tok_s"]) == set(hybrid.BATCH_MODES)
        for f in d["figures"]:
            assert all(len(f["values"][s]["runs"]) == 1 for s in ("ember", "llama.cpp")), f["key"]
        split = d["op_split"]
        assert split["labelled"] and set(split["ms"]) == set(op_split.CATEGORIES) and split["step_ms"] > 0
        assert split["ms"][op_split.MATMULS] > 0 and split["ms"][op_split.HEAD] > 0
        if cpu_gated_delta_net.available():  # the fused kernels ran, and the split saw them
            assert split["ms"][op_split.GDN] > 0 and split["ms"][op_split.CONV] > 0
    ember = data["files"]["q8_0"]["sides"]["ember"]
    assert ember["model"].endswith(".q8_0.gguf") and ember["speculation"] == "none"
    # --in-process: one process's RSS, so that bar is not judged
    rss = [b for b in data["bars"] if b["figure"] == "peak_rss"]
    assert all(b["result"].startswith("n/a") for b in rss)
    assert "--files bf16,q8_0" in data["command"] and "--llamacpp-batch best" in data["command"]


@pytest.mark.engine
@pytest.mark.usefixtures("one_thread")
def test_the_moe_file_writes_its_rows(tmp_path):
    """--files moe_bf16: a toy Qwen3.5-MoE folder (TINY's layers, QWEN35_MOE_SMALL's kind of MLP: routed experts
    and a shared one) converted by llama.cpp's converter, run by ember: the file's rows."""
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    assert set(moe) == set(QWEN35_MOE_SMALL) - set(QWEN35_08B)
    shape = {k: v for k, v in TINY.items() if k != "intermediate_size"} | moe
    folder = build_folder(str(tmp_path / "q35moe"), shape=shape, arch="Qwen3_5Moe")
    md = tmp_path / "hybrid.md"
    argv = ["bench", "hybrid", *TOY, "--moe-model-dir", folder, "--files", "moe_bf16", "--output", str(md)]
    assert main(argv + ["--peer", "none"]) == 0
    text = md.read_text()
    for r in ROWS[:3] + ROWS[4:5]:
        assert re.search(rf"\| MoE BF16 \| {r} \| [0-9][^|]* \|", text), r
    data = json.loads((tmp_path / "hybrid-hybrid.json").read_text())
    assert list(data["files"]) == ["moe_bf16"] and data["files"]["moe_bf16"]["path"].endswith(".bf16.gguf")
    assert "--moe-model-dir" in data["command"]


def test_the_split_adds_up_to_the_profiled_step():
    totals = {"step": 10_000, "forward": 7_000, "matmuls": 4_000, "LM head": 2_000, "GDN core": 500, "conv": 100}
    s = op_split.split({**totals, "full attention": 400}, steps=2, unprofiled_ms=4.0, executor="eager")
    assert s["ms"] == pytest.approx(
        {
            "matmuls": 2.0,
            "LM head": 1.0,
            "GDN core": 0.25,
            "conv": 0.05,
            "full attention": 0.2,
            "norms and glue": 1.0,
            "engine": 0.5,
        }
    )
    assert sum(s["percent"].values()) == pytest.approx(100) and s["step_ms"] == 4.0 and s["labelled"]
    # a compiled graph's step: no module boundaries, only the kernel ops are told apart
    graph = op_split.split(
        {"step": 4_000, "GDN core": 400, "conv": 200}, steps=1, unprofiled_ms=3.0, executor="compiled"
    )
    assert (
        not graph["labelled"] and graph["percent"]["GDN core"] == pytest.approx(10) and graph["ms"]["matmuls"] is None
    )


def test_defaults_write_their_own_section_over_the_three_files():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([])
    assert args.output == "benchmarks/hybrid.md" and args.prompt_lens == [2000] and args.num_prompts == 16
    assert args.files == ["bf16", "q8_0", "q4_k_m"] and args.peer == ["llamacpp"] and args.output_len == 128
    assert args.input_len_range == [128, 512] and args.llamacpp_batch == "best" and args.split_steps == 8
    assert parser.parse_args(["--files", "Q8_0"]).files == ["q8_0"]
    assert parser.parse_args(["--files", "moe_bf16"]).files == ["moe_bf16"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--files", "q5_k"])
