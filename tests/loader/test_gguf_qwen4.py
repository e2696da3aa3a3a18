"""qwen4_exp from GGUF files written by llama.cpp's own converter (conversion/qwen4exp.py) and quantizer
(llama_model_quantize), from a tiny random qwen4_exp (tests/models/tiny_qwen4.py at hidden 128, so that the
n-gram table's rows of 32 take 32-element block types and the hyper-connection down-projections (input 512)
take 256-element ones; Qwen's 151,936-id vocabulary, the only kind of tokenizer the converter takes).

- The converter under transformers >= 5.23 writes every attention.compress_ratios entry 0, which llama.cpp
  runs dense: ember reads such a file as ratio 4 and says so. The logprob checks use a copy whose key is set
  to [0, 4, 0, 4] with gguf-py (what a correct conversion writes), and first show that llama.cpp runs it
  sparse (its prompt logprobs past the budget move away from the dense run's).
- The attention is sharpened (o_proj x 8, q/k norm gammas + 2) so that dropping blocks moves the logits
  well above llama.cpp's rounding noise, and the weights are rounded to bf16 so the bf16 file holds the
  folder's values exactly (ember on the file against ember on the folder: float32 noise only)."""

from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench.peers.llamacpp_convert import convert, quantize, set_metadata_ints, write_qwen_tokenizer
from ember.errors import ModelLoadError
from ember.loader.gguf import GGUFCheckpoint
from tests.models.tiny_models import one_thread  # noqa: F401
from tests.models.tiny_qwen4 import build_qwen4

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
llama_cpp = pytest.importorskip("llama_cpp")  # the bench extra: pip install -e '.[bench]'

VOCAB = 151936
RATIOS = [0, 4, 0, 4]  # the tiny config's layer types: QSA on layers 1 and 3
SHORT, LONG = 20, 230  # dense (<= 67 visible tokens: budget 64 + ratio 4 - 1) and sparse
FILES = ("bf16", "q8_0", "q4_k_m", "q2_k")


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 150000, (n,), generator=g).tolist()


def set_ratios(path: str, ratios: list[int]) -> str:
    """The file's attention.compress_ratios, as a correct conversion writes them."""
    return set_metadata_ints(path, "qwen4exp.attention.compress_ratios", ratios)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("gguf-qwen4"))
    model = build_qwen4(vocab_size=VOCAB, hidden_size=128)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn.o_proj" in name:
                p.mul_(8)
            if "self_attn.q_norm" in name or "self_attn.k_norm" in name:
                p.add_(2)
            p.copy_(p.bfloat16().float())
    folder = os.path.join(root, "qwen4")
    model.save_pretrained(folder)
    write_qwen_tokenizer(folder)
    out = {"folder": folder, "trap": convert(folder, folder + ".trap.bf16.gguf", "bf16")}
    out["bf16"] = set_ratios(shutil.copyfile(out["trap"], folder + ".bf16.gguf"), RATIOS)
    for ftype in FILES[1:]:
        out[ftype] = quantize(out["bf16"], f"{folder}.{ftype}.gguf", ftype.upper(), threads=1)
    return out


def llm(path):
    return LLM(path, dtype="float32", kv_cache_memory=0.02, max_model_len=512, num_threads=1, max_num_seqs=2)


def llama_logprobs(path: str, ids: list[int]) -> torch.Tensor:
    """llama.cpp's log-probabilities after every prompt token, [len(ids), vocab] float64."""
    peer = llama_cpp.Llama(path, logits_all=True, n_threads=1, n_ctx=512, verbose=False)
    peer.eval(ids)
    out = torch.log_softmax(torch.tensor(peer.scores[: len(ids)]).double(), -1)
    peer.close()
    return out


def ember_prompt_logprobs(engine, ids: list[int]):
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20, prompt_logprobs=20)
    out = engine.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return out.prompt_logprobs, out.outputs[0]


def top20_gap(ours, theirs: torch.Tensor, positions) -> float:
    """Largest |ember - peer| over ember's top 20 at each position; ours[i] predicts token i (from the
    logits after token i - 1), theirs[i - 1] the same."""
    gap = 0.0
    for i in positions:
        top = sorted(ours[i], key=lambda t: -ours[i][t].logprob)[:20]
        gap = max(gap, max(abs(ours[i][t].logprob - float(theirs[i - 1, t])) for t in top))
    return gap


def test_the_files_hold_what_the_converter_and_quantizer_write(files):
    """A check of the fixture: the trap file's ratios are all 0, the others the patched ones; the quantized
    files hold block types in the table and 256-block types (Q2_K and the like) in some matrices."""
    assert GGUFCheckpoint(files["trap"]).metadata("qwen4exp.attention.compress_ratios") == [0, 0, 0, 0]
    types = {}
    for f in FILES:
        ckpt = GGUFCheckpoint(files[f])
        assert ckpt.metadata("qwen4exp.attention.compress_ratios") == RATIOS
        types[f] = {t.name: t.tensor_type.name for t in ckpt._reader.tensors}
    assert types["q8_0"]["per_layer_token_embd.weight"] == "Q8_0"
    assert types["q4_k_m"]["per_layer_token_embd.weight"] not in ("BF16", "F16", "F32")
    assert {"Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"} & set(types["q2_k"].values()), types["q2_k"]


def test_an_all_zero_compress_ratio_reads_as_4_with_a_warning(files, caplog):
    with caplog.at_level(logging.WARNING, logger="ember.loader.gguf_qwen4"):
        cfg = GGUFCheckpoint(files["trap"]).config
    assert cfg["indexer_compress_ratio"] == 4
    assert "all 0" in caplog.text and "transformers >= 5.23" in caplog.text
    assert GGUFCheckpoint(files["bf16"]).config["indexer_compress_ratio"] == 4  # the patched file's own


def test_config_and_table_come_from_the_file(files):
    """The PLE hash parameters the file does not store (seed, prime base, padding) are recovered so that
    ember's hash derives its constants; the table is one row source over the file, counted as mapped."""
    from ember.layers.table_rows import GGUFRows

    folder_cfg = GGUFCheckpoint(files["bf16"]).config
    assert (folder_cfg["seed"], folder_cfg["ngram_vocab_size_base"]) == (1234, 1009)
    assert folder_cfg["ple_layer_ids"] == [3] and folder_cfg["eos_token_id"][0] == 1
    ckpt = GGUFCheckpoint(files["q8_0"])
    table = [w for name, w in ckpt.iter_weights(packed=True) if "ngram_embedding" in name]
    assert len(table) == 1 and isinstance(table[0], GGUFRows) and table[0].qtype.name == "Q8_0"
    assert ckpt.mapped_tensor_bytes == table[0].nbytes
    assert "per_layer_token_embd.weight" not in [t[0] for t in ckpt.loaded_tensor_infos()]


def test_the_bf16_file_gives_the_folders_logits(files):
    """ember on the bf16 file against ember on the HF folder whose weights it holds: the 1 + w norms
    unfolded, the joined indexer projection, the untiled value heads and the table's rows are the folder's
    (measured: max |d logprob| 1e-6 on the top 20, dense and sparse)."""
    ids = [prompt(SHORT, 1), prompt(LONG, 2)]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=20, ignore_eos=True)
    ours, theirs = (
        llm(p).generate([{"prompt_token_ids": q} for q in ids], params, use_tqdm=False)
        for p in (files["bf16"], files["folder"])
    )
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            assert max(abs(la[t].logprob - lb[t].logprob) for t in la) < 1e-4


@pytest.mark.parametrize("ftype", FILES)
def test_top20_logprobs_agree_with_llama_cpp_on_the_same_file(files, ftype):
    """ember's top-20 prompt logprobs against llama.cpp's on the same file, at every position of a 230-token
    prompt: the dense regime (<= 67 visible tokens) and the sparse one (QSA drops blocks)."""
    ids = prompt(LONG, 2)
    ours, last = ember_prompt_logprobs(llm(files[ftype]), ids)
    theirs = llama_logprobs(files[ftype], ids)
    dense, sparse = range(1, 68), range(68, LONG)
    assert last.token_ids[0] == int(theirs[-1].argmax()) or ftype != "bf16"
    gaps = top20_gap(ours, theirs, dense), top20_gap(ours, theirs, sparse)
    assert gaps[0] < TOLERANCE[ftype][0], gaps
    assert gaps[1] < TOLERANCE[ftype][1], gaps
    if ftype == "bf16":  # llama.cpp really is sparse: the dense-ratio file's logprobs are further off
        dense_run = llama_logprobs(files["trap"], ids)
        assert top20_gap(ours, dense_run, dense) < TOLERANCE[ftype][0]
        assert top20_gap(ours, dense_run, sparse) > 2 * gaps[1]


# (dense regime, sparse regime) max |d logprob| on ember's top 20. Measured (2 cores, AVX2): bf16 8.3e-3 /
# 7.4e-2, Q8_0 1.6e-2 / 7.2e-2, Q4_K_M 1.2e-2 / 7.3e-2, Q2_K mix 1.0e-2 / 8.1e-2; llama.cpp's dense run of the
# same weights is > 0.15 off in the sparse regime. The sparse band is llama.cpp's own QSA against
# transformers' (its qwen4exp.cpp: "do not use it as a reference"): on a one-attention-layer variant
# transformers itself is 1.2e-2 to 2.4e-2 from llama.cpp there while ember is transformers' to 1e-6.
TOLERANCE = {"bf16": (2e-2, 0.12), "q8_0": (3e-2, 0.12), "q4_k_m": (3e-2, 0.12), "q2_k": (3e-2, 0.12)}


def renamed(src: str, dst: str, old: bytes, new: bytes) -> str:
    """A copy of src with one metadata key or tensor name renamed (same length: offsets stay)."""
    data = open(src, "rb").read()
    assert len(old) == len(new) and data.count(old) == 1
    with open(dst, "wb") as f:
        f.write(data.replace(old, new))
    return dst


@pytest.mark.parametrize(
    "old, new, message",
    [
        (
            b"qwen4exp.ple.head_offsets",
            b"qwen4exp.ple.head_offsetz",
            r"lacks qwen4exp\.ple\.head_offsets, one of the PLE",
        ),
        (b"per_layer_token_embd.weight", b"per_layer_token_embX.weight", r"no per_layer_token_embd\.weight tensor"),
        (b"qwen4exp.ple.eos_token_id", b"qwen4exp.ple.eos_token_iX", r"lacks metadata qwen4exp\.ple\.eos_token_id"),
        (b"qwen4exp.hyper_connection.low_rank", b"qwen4exp.hyper_connection.low_ranX", r"hyper_connection\.low_rank"),
    ],
)
def test_a_file_missing_a_ple_constant_the_table_or_a_key_is_refused_by_name(files, tmp_path, old, new, message):
    broken = renamed(files["bf16"], str(tmp_path / "broken.gguf"), old, new)
    with pytest.raises(ModelLoadError, match=message):
        GGUFCheckpoint(broken)


def test_inconsistent_hyper_connection_keys_are_refused_by_name(files, tmp_path):
    broken = set_metadata_ints(
        shutil.copyfile(files["bf16"], str(tmp_path / "hc.gguf")), "qwen4exp.hyper_connection.count", [3]
    )
    with pytest.raises(ModelLoadError, match=r"hyper_connection\.count 3 .* do not fit output_hc_down\.weight"):
        GGUFCheckpoint(broken)


# every ggml type a table's rows can take (32-element blocks; 256 for rows that are that wide), and floats
_ROW_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL", "MXFP4"]
_ROW_TYPES += ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
_ROW_TYPES += ["IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0"]


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random scales: some are NaN or inf, on both sides
@pytest.mark.parametrize("qtype", _ROW_TYPES)
def test_gguf_rows_read_exactly_gguf_pys_values_of_the_asked_rows(tmp_path, qtype):
    """GGUFRows over a table of random blocks at an offset inside a file: the rows asked for (repeated, out
    of order) are gguf-py's dequantization of the whole table at those rows, bit for bit (NaNs included)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    from ember.layers.table_rows import GGUFRows, table_rows

    t = GGMLQuantizationType[qtype]
    block, size = GGML_QUANT_SIZES[t]
    dim, num_rows, offset = max(block, 64), 37, 4096 + 7
    blocks = np.random.default_rng(0).integers(0, 256, (num_rows, dim // block * size), dtype=np.uint8)
    path = tmp_path / "table.bin"
    path.write_bytes(b"x" * offset + blocks.tobytes())
    rows = GGUFRows(str(path), offset, int(t), num_rows, dim)
    assert table_rows(rows) is rows and rows.mapped and rows.nbytes == blocks.nbytes
    if qtype in ("F32", "F16", "BF16"):
        whole = (
            torch.frombuffer(
                bytearray(blocks.tobytes()),
                dtype=getattr(torch, {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}[qtype]),
            )
            .view(num_rows, dim)
            .float()
            .numpy()
        )
    else:
        whole = np.asarray(dequantize(blocks, t), dtype=np.float32).reshape(num_rows, dim)
    asked = torch.tensor([5, 0, 36, 5, 17])
    np.testing.assert_array_equal(rows.read(asked, torch.float32).numpy(), whole[asked.numpy()])
    assert rows.read(asked[:0], torch.float32).shape == (0, dim)


def test_plan_and_the_start_line_count_the_table_as_read_by_row(files, caplog):
    """ember plan on the Q4_K_M file (its table Q5_0, unlike its matrices): the mapped bytes are the table's
    own, as the loaded engine reports them (the start-up line's "read by row from the file's mapping")."""
    from ember.config import EngineConfig
    from ember.engine import planner

    table = GGUFCheckpoint(files["q4_k_m"]).mapped_tensor_bytes
    assert table == 4096 * 32 // 32 * 22  # 4,096 rows of 32 in Q5_0 blocks of 22 bytes
    p = planner.plan(EngineConfig(model=files["q4_k_m"], device="cpu", dtype="float32"), memory_gib=4)
    assert p.mapped_weight_bytes == table
    assert "read by row from the file" in planner.format_plan(p)
    with caplog.at_level(logging.INFO):
        engine = llm(files["q4_k_m"])
    assert engine.engine.parts.loaded.mapped_weight_bytes == table
    assert f"+ {table / 1e6:.1f} MB read by row from the file's mapping" in caplog.text
