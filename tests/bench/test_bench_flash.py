"""`ember bench flash`: a toy of its Flash-Next-shaped model (flash_model.FLASH_SMALL's kinds of layers at tiny
sizes) written by transformers, converted by llama.cpp's converter (compress ratios set as a correct
conversion writes them), quantized by llama.cpp's quantizer; one file's whole run against the real llama.cpp
writes every row, qwen4_exp's per-op split, the table's residency row and every bar. And the residency probe
itself, on a mapping of this process."""

import json
import mmap
import os
import re
import types

import pytest

from ember.bench.commands import flash
from ember.bench.lib import flash_model, op_split
from ember.bench.lib.residency import PAGE, resident_bytes
from ember.entrypoints.cli import main
from ember.loader.gguf import GGUFCheckpoint
from tests.bench.test_bench_hybrid import TOY
from tests.models.tiny_models import one_thread  # noqa: F401

TINY = dict(
    flash_model.FLASH_SMALL,
    hidden_size=128,
    num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    linear_num_key_heads=2,
    linear_num_value_heads=6,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    hc_lowrank=16,
    ple_embed_dim=128,
    heads_per_ngram=2,
    ngram_vocab_size_base=1000,
    split_ngram_parts=2,
    indexer_n_heads=2,
    indexer_head_dim=16,
    indexer_budget=8,
    rope_parameters=dict(flash_model.FLASH_SMALL["rope_parameters"], mrope_section=[2, 1, 1]),
    max_position_embeddings=4096,
)


def test_resident_bytes_counts_the_touched_pages_of_a_files_range(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * PAGE))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert resident_bytes(os.getpid(), str(path), 0, 64 * PAGE) <= 64 * PAGE
        m.madvise(mmap.MADV_DONTNEED)
        assert resident_bytes(os.getpid(), str(path), 0, 64 * PAGE) == 0
        for page in (3, 10, 11):
            m[page * PAGE]  # touch: the kernel maps up to 16 pages around a fault too (fault-around)
        assert 3 * PAGE <= resident_bytes(os.getpid(), str(path), 0, 64 * PAGE) <= 32 * PAGE
        assert resident_bytes(os.getpid(), str(path), 3 * PAGE, PAGE) == PAGE
        assert resident_bytes(os.getpid(), str(path), 10 * PAGE + 5, PAGE) == 2 * PAGE  # straddles 10 and 11
        assert resident_bytes(os.getpid(), str(path), 32 * PAGE, 32 * PAGE) == 0  # no fault near these
    assert resident_bytes(os.getpid(), str(path), 0, 64 * PAGE) == 0  # unmapped


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return flash_model.build_folder(str(tmp_path_factory.mktemp("flash") / "q38"), shape=TINY)


@pytest.mark.engine
@pytest.mark.usefixtures("one_thread")
def test_one_file_writes_every_row_split_table_row_and_bar(folder, tmp_path):
    q8 = flash.build_file(folder, "q8_0")
    ckpt = GGUFCheckpoint(q8)
    assert ckpt.metadata("qwen4exp.attention.compress_ratios") == [0, 0, 0, 4]
    assert flash.table_range(q8)[1] > 0
    md = tmp_path / "flash.md"
    argv = ["bench", "flash", *TOY, "--model-dir", folder, "--files", "q8_0", "--output", str(md)]
    argv += ["--table-decode", "8"]
    assert main(argv) == 0
    text = md.read_text()
    for r in (r"batch-1 decode, 4 tokens \(tok/s\)", r"TTFT, 16-token prompt \(ms\)", r"peak RSS \(MiB\)"):
        assert re.search(rf"\| Q8_0 \| {r} \| [0-9][^|]* \| [0-9][^|]* \| [0-9.]+x[^|]* \|", text), r
    assert re.search(r"\| Q8_0 \| [0-9.]+ \| [0-9.]+ \([0-9.]+%\) \| [0-9.]+ \([0-9.]+%\) \|", text)  # the table
    for bar in (
        r"batch-1 decode >= 1\.0x llama\.cpp",
        r"peak RSS <= 1\.0x",
        r"the n-gram table.s resident bytes < 10%",
    ):
        assert re.search(rf"\| Q8_0: {bar}[^|]* \| [^|]+ \| \*\*(PASS|FAIL|n/a[^*]*)\*\* \|", text), bar
    data = json.loads((tmp_path / "flash-flash.json").read_text())
    d = data["files"]["q8_0"]
    assert set(d["table"]["resident"]) == {"ember", "llama.cpp"} and d["table"]["bytes"] == flash.table_range(q8)[1]
    # achieved bandwidth: a token's bytes (k of E experts, one embedding row, a row a head of the table), both sides
    per_token = flash.token_bytes(q8)
    assert d["bandwidth"]["ember"]["weight_bytes"] == d["bandwidth"]["llama.cpp"]["weight_bytes"] == per_token
    tensors = {t.name: t for t in ckpt._reader.tensors}
    experts = sum(int(t.n_bytes) for n, t in tensors.items() if "_exps." in n)
    table, embd = tensors["per_layer_token_embd.weight"], tensors["token_embd.weight"]
    rest = sum(int(t.n_bytes) for t in tensors.values()) - experts - int(table.n_bytes) - int(embd.n_bytes)
    cfg = ckpt.config
    row = int(table.n_bytes) * int(table.shape[0]) // int(table.n_elements)
    want = rest + experts * cfg["num_experts_per_tok"] // cfg["num_experts"]
    want += (cfg["ngram_size"] - 1) * cfg["heads_per_ngram"] * row
    want += int(embd.n_bytes) * int(embd.shape[0]) // int(embd.n_elements)
    assert abs(per_token - want) <= 64, (per_token, want)  # per-tensor integer division
    split = d["op_split"]
    assert split["labelled"] and list(split["ms"]) == list(op_split.QWEN4_CATEGORIES)
    for c in (op_split.HC, op_split.PLE, op_split.GDN_LAYER, op_split.QSA_SCORING, op_split.SELECTED):
        assert split["ms"][c] > 0, c
    for c in (op_split.ROUTER, op_split.EXPERTS, op_split.HEAD):
        assert split["ms"][c] > 0, c


@pytest.mark.engine
@pytest.mark.usefixtures("one_thread")
def test_the_q4_k_m_file_gets_an_ember_side_with_a_random_mtp_layer(folder, tmp_path):
    """--mtp (the default): a random MTP layer written beside the model folder as train-mtp writes one
    (mtp.* tensors, config.json naming the model), attached to the Q4_K_M GGUF, which has none; the ember+MTP
    side takes the decode rounds only and gets its own rows (its decode against ember's, the drafting of
    its rounds, a draft step's measured cost against a decode step and the engine's estimate), the main
    table's columns unchanged."""
    from safetensors import safe_open

    md = tmp_path / "flash.md"
    argv = ["bench", "flash", *TOY, "--model-dir", folder, "--files", "q4_k_m", "--output", str(md)]
    argv += ["--peer", "none", "--split-steps", "0", "--bandwidth-mib", "0", "--table-decode", "2"]
    assert main(argv) == 0
    mtp_dir = flash_model.mtp_folder_of(folder)
    with safe_open(os.path.join(mtp_dir, "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith("mtp.") for n in names) and "mtp.layers.0.mlp.gate.weight" in names
    assert json.load(open(os.path.join(mtp_dir, "config.json")))["architectures"] == ["Qwen4ExpForCausalLM"]
    text = md.read_text()
    assert "| file | metric | ember |\n" in text  # the main table: no ember+MTP column
    num = r"[0-9][0-9.]*"
    cells = [rf"{num}[^|]*", rf"{num}x[^|]*", "-", r"\d+ \(\d+ drafts, 0 accepted\)", num, num, num, num]
    assert re.search(r"\| Q4_K_M \| batch-1 decode, 4 tokens \(tok/s\) \| " + r" \| ".join(cells) + r" \|", text)
    d = json.loads((tmp_path / "flash-flash.json").read_text())["files"]["q4_k_m"]
    assert d["sides"][flash.MTP]["speculation"] == "mtp" and d["sides"]["ember"]["speculation"] == "none"
    values = {f["key"]: f["values"] for f in d["figures"]}
    assert flash.MTP in values["decode"] and flash.MTP not in values["throughput"]
    assert set(d["table"]["resident"]) == {"ember"}
    cost = d["mtp"]
    assert cost["drafts"] > 0 and cost["draft_ms"] > 0 and 0 < cost["fraction"] and 0 < cost["estimate"] <= 1
    assert cost["rounds"]["num_accepted_tokens"] == 0


def test_a_compiled_qwen4_step_is_split_on_its_eager_run_and_its_graphs_come_back():
    """qwen4_exp's kinds of work are modules, which a compiled graph hides: decode_split profiles them with the
    executor's graphs set aside, and hands them back after (also when the profile fails)."""
    graphs = {(1, 1): object()}
    executor = types.SimpleNamespace(ready=graphs)
    with op_split._eager_steps(executor, True) as eager:
        assert eager and executor.ready == {}
    assert executor.ready is graphs
    with pytest.raises(RuntimeError), op_split._eager_steps(executor, True):
        raise RuntimeError
    assert executor.ready is graphs
    for wanted, ex in ((False, executor), (True, types.SimpleNamespace(ready={})), (True, object())):
        with op_split._eager_steps(ex, wanted) as eager:
            assert not eager
    assert executor.ready is graphs
