"""Hybrid Qwen models (Qwen3-Next, Qwen3.5 dense and MoE, the Qwen3.5 VL checkpoint served as text)
against transformers on tiny random fp32 models with odd shapes (tests/models/tiny_hybrids.py):
logits within 1e-4 relative, whole or split into chunks that continue the recurrent state, and 32
greedy tokens through the engine. Plus the weight layouts and the configs ember refuses."""

import json
import shutil

import pytest
import torch

from ember import LLM, SamplingParams
from ember.config.model_config import ModelConfig
from ember.errors import ModelLoadError
from ember.kernels.metadata import AttentionMetadata, RecurrentMetadata
from ember.kernels.torch_attention import TorchAttentionBackend
from ember.loader.weights import iter_safetensors
from ember.models.registry import get_model_class
from tests.models.tiny_hybrids import HYBRID_ARCHS, VOCAB, build_hybrid
from tests.models.tiny_models import hf_greedy, one_thread, random_prompt  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_thread")


def load(path):
    cfg = ModelConfig.from_folder(path)
    model = get_model_class(cfg.architecture)(
        cfg, dtype=torch.float32, device="cpu", attn_backend=TorchAttentionBackend()
    )
    model.load_weights(iter_safetensors(path, progress=False))
    return model.eval()


@torch.inference_mode()
def ember_logits(model, ids: list[int], cuts: list[int], block_size: int = 8) -> torch.Tensor:
    """One sequence run as consecutive steps ending at `cuts` (state carried in slot 1)."""
    cfg = model.cfg
    blocks = -(-len(ids) // block_size)
    states = model.make_recurrent_states(2, "cpu")
    caches = [
        st if st is not None else torch.randn(2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim) for st in states
    ]
    for st in states:  # garbage in the slot: a first step must not read it
        if st is not None:
            st.ssm.normal_()
            st.conv.normal_()
    out, start = [], 0
    for end in cuts:
        n = end - start
        meta = AttentionMetadata(
            slot_mapping=torch.arange(start, end),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([end], dtype=torch.int32),
            block_tables=torch.arange(blocks, dtype=torch.int32)[None],
            block_size=block_size,
            query_lens_cpu=[n],
            seq_lens_cpu=[end],
            max_query_len=n,
            max_seq_len=end,
            all_slots_valid=True,
            recurrent=RecurrentMetadata([1], [start > 0], [0], [[]]),
        )
        h = model(torch.tensor(ids[start:end]), torch.arange(start, end), caches, meta)
        out.append(model.compute_logits(h))
        start = end
    return torch.cat(out)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_logits_match_transformers_whole_and_chunked(arch, tiny_hybrid_dir):
    hf, model = build_hybrid(arch), load(tiny_hybrid_dir(arch))
    ids = random_prompt(83, seed=5)
    ids = [t % VOCAB for t in ids]
    with torch.inference_mode():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    scale = ref.abs().max()
    for cuts in ([83], [1, 2, 9, 70, 71, 83], [64, 65, 66, 67, 83]):  # one token, chunks past 64, decodes
        got = ember_logits(model, ids, cuts)
        assert (got - ref).abs().max() / scale < 1e-4, (arch, cuts)
        assert torch.equal(got.argmax(-1), ref.argmax(-1)), (arch, cuts)


@pytest.mark.engine
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_engine_greedy_32_tokens_match_transformers(arch, tiny_hybrid_dir):
    hf = build_hybrid(arch)
    llm = LLM(
        tiny_hybrid_dir(arch),
        dtype="float32",
        block_size=4,
        max_model_len=128,
        num_threads=1,
        kv_cache_memory=0.005,
        max_num_seqs=4,
    )
    prompts = [[t % VOCAB for t in random_prompt(n, 40 + n)] for n in (1, 13, 40)]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
        use_tqdm=False,
    )
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 32), (arch, len(p))
    states = llm.engine.parts.kv.states
    assert states.num_free == states.num_live == 4  # every slot back


def test_vl_checkpoint_skips_the_vision_tower_and_loads_the_text_model(tiny_hybrid_dir, caplog):
    path = tiny_hybrid_dir("qwen3_5_vl")
    with open(f"{path}/config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    with caplog.at_level("INFO"):
        model = load(path)
    assert "skipped" in caplog.text and "model.visual" in caplog.text
    assert model.cfg.tie_word_embeddings  # the checkpoint's top-level flag, not text_config's


def test_qwen3_next_interleaved_projections_equal_the_split_layout(tiny_hybrid_dir):
    """Qwen3-Next stores in_proj_qkvz / in_proj_ba interleaved per key-head group; ember holds the
    split layout Qwen3.5 stores: the loaded weights are the de-interleaved rows."""
    hf = build_hybrid("qwen3_next")
    model = load(tiny_hybrid_dir("qwen3_next"))
    gdn, ours = hf.model.layers[0].linear_attn, model.model.layers[0].linear_attn
    x = torch.randn(5, hf.config.hidden_size)
    q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x)[None], gdn.in_proj_ba(x)[None])
    q2, k2, v2, z2 = ours.in_proj_qkvz(x).split([ours.in_proj_qkvz.shard_sizes[s] for s in "qkvz"], dim=-1)
    b2, a2 = ours.in_proj_ba(x).chunk(2, dim=-1)
    for theirs, mine in ((q, q2), (k, k2), (v, v2), (z, z2), (b, b2), (a, a2)):
        torch.testing.assert_close(theirs[0].reshape(5, -1), mine)


def _edit_config(src, tmp_path, **changes):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return str(dst)


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attn_output_gate=False), "attn_output_gate"),
        (dict(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype"),
        (
            dict(layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention"]),
            "layer_types",
        ),
        (dict(linear_num_value_heads=3), "linear_num_value_heads"),
    ],
)
def test_unsupported_variants_are_refused_by_name(change, words, tiny_hybrid_dir, tmp_path):
    path = _edit_config(tiny_hybrid_dir("qwen3_5"), tmp_path, **change)
    with pytest.raises(ModelLoadError, match=words):
        ModelConfig.from_folder(path)


def test_a_missing_tensor_is_named(tiny_hybrid_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    dst = tmp_path / "model"
    shutil.copytree(tiny_hybrid_dir("qwen3_5"), dst)
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.0.linear_attn.in_proj_b.weight"]
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.0\.linear_attn\.in_proj_ba\.weight \(shards \['b'\]\)"):
        load(str(dst))
