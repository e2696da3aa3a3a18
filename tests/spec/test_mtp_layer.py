"""The MTP layer (ember.models.mtp) and its weights (ember.spec.mtp_weights) against an independent
reference: plain torch + transformers' own Qwen3 / Qwen3-MoE decoder layer with the same weights.

Tiny random Qwen3 (and Qwen3-MoE) main models; a random MTP layer in each published layout, in the
main checkpoint or in a separate folder. fp32 throughout: max |Δ| <= 1e-4 x max |reference|.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ember.errors import ModelLoadError
from ember.layers.moe import SparseMoeBlock
from ember.models.mtp import ZeroCenteredRMSNorm
from ember.spec.mtp_weights import find_mtp_weights, load_mtp
from tests.models.tiny_models import load_ember_model, one_thread, random_prompt  # noqa: F401
from tests.spec.mtp_fixtures import (
    COUNT_KEY,
    LAYOUTS,
    MiniPager,
    checkpoint_tensors,
    hf_config,
    make_ref_layers,
    ref_logits,
    ref_mtp,
    write_main_with_mtp,
    write_mtp_folder,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4):
    assert got.shape == want.shape
    scale = want.abs().max().item()
    err = (got - want).abs().max().item()
    assert err <= rel * scale, f"max |diff| {err:.3g} > {rel} x {scale:.3g}"


def main_weights(main_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding, LM head) straight from the checkpoint."""
    w = load_file(os.path.join(main_dir, "model.safetensors"))
    embed = w["model.embed_tokens.weight"]
    return embed, w.get("lm_head.weight", embed)


def with_mtp(
    tiny_model_dir,
    tmp_path,
    layout: str,
    arch: str = "qwen3",
    num_layers: int = 1,
    own_head: bool = False,
    embed_copy: bool = False,
    drop=(),
    extra_config=None,
):
    """A copy of the tiny model whose checkpoint carries random MTP layers; (folder, hf_cfg, refs)."""
    main_dir = tiny_model_dir(arch)
    hf_cfg = hf_config(main_dir)
    refs = make_ref_layers(hf_cfg, layout, num_layers, own_head=own_head, arch=arch)
    embed, _ = main_weights(main_dir)
    tensors = checkpoint_tensors(
        refs,
        layout,
        hf_cfg.num_hidden_layers,
        getattr(hf_cfg, "moe_intermediate_size", 0),
        embed if embed_copy else None,
    )
    for name in drop:
        del tensors[name]
    cfg = {COUNT_KEY[layout]: num_layers, **(extra_config or {})}
    folder = write_main_with_mtp(main_dir, str(tmp_path / f"{arch}-{layout}"), tensors, cfg)
    return folder, hf_cfg, refs


def prefill_hidden(main, pager: MiniPager, ids: torch.Tensor, seq: int = 0):
    """The target's final-normed hidden states over ids (one prefill), and the step's metadata."""
    caches = [pager.cache(main.cfg, seed=10 + i) for i in range(main.cfg.num_layers)]
    meta = pager.meta([(seq, 0, len(ids))])
    with torch.inference_mode():
        h = main(ids, torch.arange(len(ids)), caches, meta)
    return h, meta


# ---- forward vs the reference ------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_reference_prefill_then_two_recursive_steps(tiny_model_dir, tmp_path, layout):
    folder, hf_cfg, refs = with_mtp(tiny_model_dir, tmp_path, layout)
    main = load_ember_model(folder)  # the main model ignores the MTP tensors
    mtp = load_mtp(main, folder, progress=False)
    assert (mtp.num_layers, mtp.layout) == (1, layout)
    assert mtp.layers[0].head is None and mtp.zero_embed_at_pos0 == (layout != "qwen3_next")
    assert isinstance(mtp.layers[0].block.input_layernorm, ZeroCenteredRMSNorm) == (layout == "qwen3_next")
    embed, lm_head = main_weights(folder)

    T = 9
    toks = torch.tensor(random_prompt(T + 1, seed=3))  # t_0 .. t_T
    pager = MiniPager()
    h, meta = prefill_hidden(main, pager, toks[:T])  # h_0 .. h_{T-1}
    cache = pager.cache(main.cfg, seed=99)
    assert mtp.kv_cache_shape(32, 4) == tuple(cache.shape)  # one more layer of the main layers' shape
    pos = torch.arange(T)
    with torch.inference_mode():
        # MTP rows: t_{i+1} at position i with h_i, in the same blocks as the main layers.
        g = mtp(toks[1:], pos, h, [cache], meta, step=0)
        logits = mtp.compute_logits(g)
    ref_g = ref_mtp(refs[0], hf_cfg, embed, toks[1:], pos, h, layout)
    assert_close(g, ref_g)
    assert_close(logits, ref_logits(refs[0], ref_g, lm_head))

    # Two recursive draft steps from the last position: the new token is the draft, the position
    # +1, the hidden the g just returned (step 1 and 2 reuse the single layer).
    ids_all, pos_all, hid_all = toks[1:].clone(), pos.clone(), h.clone()
    prev_g, prev_ref, last_logits = g[-1:], ref_g[-1:], logits[-1]
    for step in (1, 2):
        draft = last_logits.argmax().view(1)
        p = T - 1 + step
        with torch.inference_mode():
            g_step = mtp(draft, torch.tensor([p]), prev_g, [cache], pager.meta([(0, p, 1)]), step=step)
            last_logits = mtp.compute_logits(g_step, step=step)[0]
        ids_all, pos_all = torch.cat([ids_all, draft]), torch.cat([pos_all, torch.tensor([p])])
        hid_all = torch.cat([hid_all, prev_ref])
        full = ref_mtp(refs[0], hf_cfg, embed, ids_all, pos_all, hid_all, layout)  # full recompute
        assert_close(g_step, full[-1:])
        prev_g, prev_ref = g_step, full[-1:]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_embedding_zeroed_at_position_zero_except_qwen3_next(tiny_model_dir, tmp_path, layout):
    folder, _, _ = with_mtp(tiny_model_dir, tmp_path, layout)
    main = load_ember_model(folder)
    mtp = load_mtp(main, folder, progress=False)
    hidden = torch.randn(3, main.cfg.hidden_size)
    outs = []
    for first in (5, 700):
        pager = MiniPager()
        with torch.inference_mode():
            outs.append(
                mtp(
                    torch.tensor([first, 8, 9]),
                    torch.arange(3),
                    hidden,
                    [pager.cache(main.cfg)],
                    pager.meta([(0, 0, 3)]),
                )
            )
    same = torch.equal(outs[0][0], outs[1][0])
    assert same == (layout != "qwen3_next")


# ---- paged KV: chunks, batching, decode rows against a full recompute -----------------------------


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next"])
def test_paged_kv_chunked_batched_decode_equals_full_recompute(tiny_model_dir, tmp_path, layout):
    folder, hf_cfg, refs = with_mtp(tiny_model_dir, tmp_path, layout)
    main = load_ember_model(folder)
    mtp = load_mtp(main, folder, progress=False)
    embed, _ = main_weights(folder)
    H = main.cfg.hidden_size
    g = torch.Generator().manual_seed(5)
    lengths = {0: 13, 1: 8}
    ids = {s: torch.tensor(random_prompt(n, seed=20 + s)) for s, n in lengths.items()}
    hid = {s: torch.randn(n, H, generator=g) for s, n in lengths.items()}
    pager = MiniPager(num_blocks=24, block_size=4, seed=1)
    cache = pager.cache(main.cfg, num_blocks=24, seed=7)
    before = cache.clone()
    # (seq, start, q_len) per step: a chunk, a chunk over a cached prefix batched with a fresh
    # prefill, a prefill tail batched with a decode row, then two decode-only steps.
    schedule = [[(0, 0, 5)], [(0, 5, 6), (1, 0, 4)], [(1, 4, 3), (0, 11, 1)], [(0, 12, 1), (1, 7, 1)]]
    out = {s: [None] * n for s, n in lengths.items()}
    for work in schedule:
        meta = pager.meta(work)
        rows_ids = torch.cat([ids[s][a : a + n] for s, a, n in work])
        rows_pos = torch.cat([torch.arange(a, a + n) for s, a, n in work])
        rows_hid = torch.cat([hid[s][a : a + n] for s, a, n in work])
        with torch.inference_mode():
            y = mtp(rows_ids, rows_pos, rows_hid, [cache], meta)
        r = 0
        for s, a, n in work:
            for i in range(n):
                out[s][a + i] = y[r + i]
            r += n
    for s, n in lengths.items():
        want = ref_mtp(refs[0], hf_cfg, embed, ids[s], torch.arange(n), hid[s], layout)
        assert_close(torch.stack(out[s]), want)
    # Exactly the scheduled slots were written, nothing else.
    used = torch.zeros(cache.shape[1] * cache.shape[2], dtype=torch.bool)
    for s, n in lengths.items():
        for p in range(n):
            used[pager.tables[s][p // 4] * 4 + p % 4] = True
    flat_now, flat_before = cache.flatten(1, 2), before.flatten(1, 2)
    assert torch.equal(flat_now[:, ~used], flat_before[:, ~used])
    assert not torch.isclose(flat_now[:, used], flat_before[:, used]).all(dim=(0, 2, 3)).any()


def test_row_selection_keeps_last_rows_and_writes_every_row(tiny_model_dir, tmp_path):
    folder, _, _ = with_mtp(tiny_model_dir, tmp_path, "deepseek")
    main = load_ember_model(folder)
    mtp = load_mtp(main, folder, progress=False)
    H = main.cfg.hidden_size
    ids = torch.tensor(random_prompt(11, seed=4))
    hidden = torch.randn(11, H, generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(6), torch.arange(5)])
    results = []
    for use_select in (False, True):
        pager = MiniPager(seed=3)
        cache = pager.cache(main.cfg)
        meta = pager.meta([(0, 0, 6), (1, 0, 5)])
        select = pager.last_rows(meta, pos) if use_select else None
        with torch.inference_mode():
            y = mtp(ids, pos, hidden, [cache], meta, select=select)
        results.append((y, cache))
    (full, cache_full), (sel, cache_sel) = results
    assert_close(sel, full[[5, 10]], rel=1e-5)
    assert torch.equal(cache_full, cache_sel)


# ---- several layers, own heads, MoE, separate folder -----------------------------------------------


def test_two_layers_taken_in_turn_with_own_heads(tiny_model_dir, tmp_path):
    folder, hf_cfg, refs = with_mtp(tiny_model_dir, tmp_path, "deepseek", num_layers=2, own_head=True, embed_copy=True)
    main = load_ember_model(folder)
    mtp = load_mtp(main, folder, progress=False)
    assert mtp.num_layers == 2 and all(layer.head is not None for layer in mtp.layers)
    assert [mtp.layer_for_step(k) for k in range(5)] == [0, 1, 0, 1, 0]
    embed, _ = main_weights(folder)
    T = 6
    toks = torch.tensor(random_prompt(T, seed=8))
    hidden = torch.randn(T, main.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    pager = MiniPager()
    caches = [pager.cache(main.cfg, seed=1), pager.cache(main.cfg, seed=2)]
    meta = pager.meta([(0, 0, T)])
    pos = torch.arange(T)
    for step in (0, 1):  # each layer over the same rows, into its own cache
        with torch.inference_mode():
            g = mtp(toks, pos, hidden, caches, meta, step=step)
            logits = mtp.compute_logits(g, step=step)
        ref_g = ref_mtp(refs[step], hf_cfg, embed, toks, pos, hidden, "deepseek")
        assert_close(g, ref_g)
        assert_close(logits, ref_logits(refs[step], ref_g, embed))
    # step 2 (k > n) is layer 0 again, reading layer 0's cache
    new_tok, new_hid = torch.tensor([17]), torch.randn(1, main.cfg.hidden_size)
    with torch.inference_mode():
        g2 = mtp(new_tok, torch.tensor([T]), new_hid, caches, pager.meta([(0, T, 1)]), step=2)
    full = ref_mtp(
        refs[0],
        hf_cfg,
        embed,
        torch.cat([toks, new_tok]),
        torch.arange(T + 1),
        torch.cat([hidden, new_hid]),
        "deepseek",
    )
    assert_close(g2, full[-1:])


def test_moe_model_with_deepseek_layout_moe_block(tiny_model_dir, tmp_path):
    folder, hf_cfg, refs = with_mtp(
        tiny_model_dir, tmp_path, "deepseek", arch="qwen3_moe", own_head=True, embed_copy=True
    )
    main = load_ember_model(folder)
    mtp = load_mtp(main, folder, progress=False)
    assert isinstance(mtp.layers[0].block.mlp, SparseMoeBlock)  # index 3 is sparse, as the main layers' rule says
    embed, _ = main_weights(folder)
    T = 8
    toks = torch.tensor(random_prompt(T + 1, seed=12))
    pager = MiniPager()
    h, meta = prefill_hidden(main, pager, toks[:T])
    cache = pager.cache(main.cfg, seed=5)
    with torch.inference_mode():
        g = mtp(toks[1:], torch.arange(T), h, [cache], meta)
        logits = mtp.compute_logits(g)
    ref_g = ref_mtp(refs[0], hf_cfg, embed, toks[1:], torch.arange(T), h, "deepseek")
    assert_close(g, ref_g)
    assert_close(logits, ref_logits(refs[0], ref_g, embed))
    draft = logits[-1].argmax().view(1)
    with torch.inference_mode():
        g2 = mtp(draft, torch.tensor([T]), g[-1:], [cache], pager.meta([(0, T, 1)]), step=1)
    full = ref_mtp(
        refs[0],
        hf_cfg,
        embed,
        torch.cat([toks[1:], draft]),
        torch.arange(T + 1),
        torch.cat([h, ref_g[-1:]]),
        "deepseek",
    )
    assert_close(g2, full[-1:])


@pytest.mark.parametrize("layout", ["deepseek", "qwen3_next"])
def test_separate_folder_with_its_own_smaller_block(tiny_model_dir, tmp_path, layout):
    main_dir = tiny_model_dir("qwen3")
    hf_cfg = hf_config(main_dir)
    small = copy.deepcopy(hf_cfg)
    small.intermediate_size = 48  # an MTP block narrower than the model's: read from the folder's config
    refs = make_ref_layers(small, layout)
    tensors = checkpoint_tensors(refs, layout, hf_cfg.num_hidden_layers)
    mtp_dir = write_mtp_folder(
        str(tmp_path / "mtp"),
        tensors,
        {
            "architectures": ["Qwen3MTP"],
            "vocab_size": hf_cfg.vocab_size,
            "hidden_size": hf_cfg.hidden_size,
            "intermediate_size": 48,
            "num_hidden_layers": 1,
            COUNT_KEY[layout]: 1,
        },
    )  # its own count: not used
    main = load_ember_model(main_dir)
    ckpt = find_mtp_weights(main.cfg, main_dir, mtp_dir)
    assert ckpt.separate and ckpt.layout == layout and ckpt.block_cfg.intermediate_size == 48
    mtp = load_mtp(main, main_dir, mtp_dir, progress=False)
    embed, _ = main_weights(main_dir)
    T = 7
    toks = torch.tensor(random_prompt(T, seed=30))
    hidden = torch.randn(T, hf_cfg.hidden_size, generator=torch.Generator().manual_seed(31))
    pager = MiniPager()
    with torch.inference_mode():
        g = mtp(toks, torch.arange(T), hidden, [pager.cache(main.cfg)], pager.meta([(0, 0, T)]))
    assert_close(g, ref_mtp(refs[0], small, embed, toks, torch.arange(T), hidden, layout))


# ---- refusals -------------------------------------------------------------------------------------


def test_refuses_when_no_mtp_weights(tiny_model_dir):
    main_dir = tiny_model_dir("qwen3")
    main = load_ember_model(main_dir)
    with pytest.raises(ModelLoadError) as e:
        load_mtp(main, main_dir, progress=False)
    msg = str(e.value)
    for pattern in ("holds no MTP weights", "eh_proj", "model.mtp_layers.{j}", "mtp.fc", "--speculative-model"):
        assert pattern in msg
    # a copy of a plain model as --speculative-model: same architecture, no MTP layers
    with pytest.raises(ModelLoadError, match=r"holds no MTP weights.*speculative method \"draft\""):
        find_mtp_weights(main.cfg, "/nonexistent-main", main_dir)


def _separate(tmp_path, tiny_model_dir, config, name="mtp"):
    main_dir = tiny_model_dir("qwen3")
    hf_cfg = hf_config(main_dir)
    tensors = checkpoint_tensors(make_ref_layers(hf_cfg, "deepseek"), "deepseek", hf_cfg.num_hidden_layers)
    folder = write_mtp_folder(str(tmp_path / name), tensors, config)
    return load_ember_model(main_dir), main_dir, folder


@pytest.mark.parametrize(
    "config, message",
    [
        (
            {"architectures": ["Qwen3MTP"], "vocab_size": 2000, "hidden_size": 64},
            r"have vocab_size 2000 but the model has 1000.*ember train-mtp",
        ),
        (
            {"architectures": ["Qwen3MTP"], "vocab_size": 1000, "hidden_size": 128},
            r"have hidden_size 128 but the model has 64",
        ),
        (
            {"architectures": ["DeepSeekMTPModel"], "vocab_size": 1000, "hidden_size": 64},
            r"architectures \['DeepSeekMTPModel'\], which is not an MTP model for this Qwen3ForCausalLM model; "
            r"ember accepts Qwen3MTP or Qwen3ForCausalLM",
        ),
        ({"vocab_size": 1000, "hidden_size": 64}, r"architectures \[\].*set \"architectures\": \[\"Qwen3MTP\"\]"),
        (None, r"has no config.json; an MTP folder needs one with architectures \['Qwen3MTP'\]"),
    ],
)
def test_refuses_bad_separate_folder(tiny_model_dir, tmp_path, config, message):
    main, main_dir, folder = _separate(tmp_path, tiny_model_dir, config)
    with pytest.raises(ModelLoadError, match=message):
        load_mtp(main, main_dir, folder, progress=False)


def test_refuses_missing_pieces_of_a_layer_naming_them(tiny_model_dir, tmp_path):
    folder, _, _ = with_mtp(
        tiny_model_dir,
        tmp_path,
        "deepseek",
        drop=("model.layers.2.enorm.weight", "model.layers.2.self_attn.k_proj.weight"),
    )
    main = load_ember_model(folder)
    with pytest.raises(ModelLoadError) as e:
        load_mtp(main, folder, progress=False)
    msg = str(e.value)
    assert "model.layers.2.enorm.weight" in msg and "model.layers.2.self_attn.k_proj.weight" in msg
    assert "q_proj" not in msg and "give the complete MTP weights" in msg


def test_refuses_missing_moe_expert_naming_it(tiny_model_dir, tmp_path):
    folder, _, _ = with_mtp(
        tiny_model_dir,
        tmp_path,
        "mimo",
        arch="qwen3_moe",
        drop=("model.mtp_layers.0.mlp.experts.5.up_proj.weight", "model.mtp_layers.0.token_layernorm.weight"),
    )
    main = load_ember_model(folder)
    with pytest.raises(ModelLoadError) as e:
        load_mtp(main, folder, progress=False)
    msg = str(e.value)
    assert "model.mtp_layers.0.mlp.experts.5.up_proj.weight" in msg
    assert "model.mtp_layers.0.token_layernorm.weight" in msg and "experts.4" not in msg


def test_refuses_fewer_layers_than_config_says(tiny_model_dir, tmp_path):
    folder, _, _ = with_mtp(tiny_model_dir, tmp_path, "deepseek", extra_config={"num_nextn_predict_layers": 2})
    main = load_ember_model(folder)
    with pytest.raises(
        ModelLoadError,
        match=r"num_nextn_predict_layers=2, but MTP layer\(s\) \[1\] are missing "
        r"\(no tensors named model\.layers\.3\.\*",
    ):
        load_mtp(main, folder, progress=False)


def test_refuses_two_layouts_in_one_folder(tiny_model_dir, tmp_path):
    main_dir = tiny_model_dir("qwen3")
    hf_cfg = hf_config(main_dir)
    refs = make_ref_layers(hf_cfg, "deepseek")
    tensors = {**checkpoint_tensors(refs, "deepseek", 2), **checkpoint_tensors(refs, "mimo", 2)}
    folder = write_main_with_mtp(main_dir, str(tmp_path / "both"), tensors, {})
    main = load_ember_model(folder)
    with pytest.raises(ModelLoadError, match="more than one layout .DeepSeek-V3/GLM, MiMo"):
        load_mtp(main, folder, progress=False)


def test_refuses_qwen3_next_gated_attention_block(tiny_model_dir, tmp_path):
    main_dir = tiny_model_dir("qwen3")
    hf_cfg = hf_config(main_dir)
    tensors = checkpoint_tensors(make_ref_layers(hf_cfg, "qwen3_next"), "qwen3_next", 2)
    q = tensors["mtp.layers.0.self_attn.q_proj.weight"]
    tensors["mtp.layers.0.self_attn.q_proj.weight"] = torch.cat([q, q])  # query + output gate rows
    folder = write_main_with_mtp(main_dir, str(tmp_path / "gated"), tensors, {"mtp_num_hidden_layers": 1})
    main = load_ember_model(folder)
    with pytest.raises(ModelLoadError, match="Qwen3-Next gated attention block"):
        load_mtp(main, folder, progress=False)


def test_refuses_gguf_main_without_mtp_tensors(tmp_path, tiny_model_dir):
    """A GGUF file without MTP tensors (a dense architecture, or a hybrid converted with --no-mtp; the
    hybrid case with llama.cpp's converter is tests/loader/test_gguf_mtp.py's) names what to change."""
    import gguf

    main = load_ember_model(tiny_model_dir("qwen3"))
    path = tmp_path / "model.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    cfg = main.cfg
    writer.add_block_count(cfg.num_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_tensor("token_embd.weight", torch.zeros(8, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="holds no MTP layer.*re-convert the model without --no-mtp"):
        find_mtp_weights(main.cfg, str(path))


def test_separate_folder_config_keys_default_to_the_model(tiny_model_dir, tmp_path):
    """A minimal MTP config (architectures only) inherits the model's shape; the count comes from the weights."""
    main, main_dir, folder = _separate(tmp_path, tiny_model_dir, {"architectures": ["Qwen3MTP"]})
    ckpt = find_mtp_weights(main.cfg, main_dir, folder)
    assert (ckpt.layout, ckpt.num_layers, ckpt.prefixes) == ("deepseek", 1, ["model.layers.2."])
    with open(os.path.join(folder, "config.json")) as f:
        assert json.load(f) == {"architectures": ["Qwen3MTP"]}
    assert load_mtp(main, main_dir, folder, progress=False).num_layers == 1
