"""`ember train-mtp`: data, dense forward, training, resume, the written folder, the reduced draft
vocabulary, and the committed MTP folder for the default model.

Tiny random models (tests/conftest.py tiny_model_dir) with tiny settings; fp32 throughout.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import ember
from ember.errors import ConfigError, ModelLoadError
from ember.models.mtp import MTPModule
from ember.spec.mtp_weights import export_deepseek_tensors, find_mtp_weights, load_mtp
from ember.train.mtp import MTPTrainer, TrainConfig, build_mtp, chain_forward, pad_batch, write_mtp_folder
from ember.train.mtp_data import build_prompts, disjoint_snippets, draft_vocabulary, make_data, snippets
from tests.models.tiny_models import load_ember_model, one_thread  # noqa: F401
from tests.spec.mtp_fixtures import MiniPager

pytestmark = pytest.mark.usefixtures("one_thread")

ASSET = os.path.join(os.path.dirname(ember.__file__), "assets", "smollm2-mtp")  # shipped as package data


def tiny_cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(
        out=str(tmp_path / "out"),
        checkpoint_dir=str(tmp_path / "ckpt"),
        num_prompts=10,
        max_new_tokens=20,
        eval_prompts=3,
        epochs=4,
        lr=3e-3,
        draft_vocab_size=300,
        depth=2,
        batch_tokens=256,
        save_every=0,
        progress=False,
        train_dtype="float32",
        engine_knobs={"kv_cache_memory": 0.02, "dtype": "float32"},
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny_data(tiny_model_dir):
    """(main model folder, fp32 ember model, MTPData) from the tiny Llama's own generations."""
    from ember import LLM

    folder = tiny_model_dir("llama")
    llm = LLM(folder, kv_cache_memory=0.02, dtype="float32", max_num_seqs=16, num_threads=1)
    main = llm.engine.parts.loaded.model
    data = make_data(
        llm, main, llm.tokenizer, num_prompts=10, max_new_tokens=20, seed=0, eval_prompts=3, progress=False
    )
    torch.set_num_threads(1)
    return folder, main, data


def randomize(mtp: MTPModule, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


# ---- data -------------------------------------------------------------------------------------------


def test_prompts_mix_chat_and_raw_greedy_and_sampled(tiny_model_dir):
    from ember.loader.tokenizer import Tokenizer
    from ember.train.calibration import pydoc_split

    tok = Tokenizer.from_folder(tiny_model_dir("llama"))
    prompts = build_prompts(tok, pydoc_split("calib"), 80, seed=3)
    assert {p.kind for p in prompts} == {"chat", "raw"}
    temps = {p.temperature for p in prompts}
    assert 0.0 in temps and temps & {0.7, 0.8}
    assert prompts == build_prompts(tok, pydoc_split("calib"), 80, seed=3)  # deterministic
    im_start = tok.token_to_id("<|im_start|>")
    assert all((im_start in p.ids) == (p.kind == "chat") for p in prompts)
    # the pydoc topics repeat paragraphs across topics: training prompts drop every snippet that shares
    # one with the held-out half, so prompts built from the held-out half are all new
    calib, heldout = pydoc_split("calib"), pydoc_split("eval")
    assert {s.text for s in snippets(calib)} & {s.text for s in snippets(heldout)}  # the overlap exists
    train = disjoint_snippets(calib, heldout)
    assert train and not {s.text for s in train} & {s.text for s in snippets(heldout)}
    used = {p.ids[-40:].__repr__() for p in build_prompts(tok, calib, 300, seed=1, exclude=heldout)}
    assert used


def test_data_keeps_generations_and_teacher_hidden_states(tiny_data):
    _, main, data = tiny_data
    assert len(data.train) == 10 and len(data.eval_greedy) == 3 and len(data.eval_sampled) == 3
    seq = data.train[0]
    assert seq.hidden.shape == (len(seq), main.cfg.hidden_size) and len(seq) > seq.prompt_len
    # the stored hidden states are the model's own: a fresh one-sequence prefill gives the same
    pager = MiniPager(num_blocks=64)
    caches = [pager.cache(main.cfg, num_blocks=64) for _ in range(main.cfg.num_layers)]
    with torch.no_grad():
        h = main(seq.ids, torch.arange(len(seq)), caches, pager.meta([(0, 0, len(seq))]))
    torch.testing.assert_close(seq.hidden, h, rtol=1e-4, atol=1e-4)
    # greedy held-out generations continue with the model's argmax
    s = data.eval_greedy[0]
    greedy = main.compute_logits(s.hidden).argmax(-1)
    assert torch.equal(greedy[s.prompt_len - 1 : -1], s.ids[s.prompt_len :])


def test_draft_vocabulary_ranks_generated_tokens_first():
    from ember.train.mtp_data import Sequence

    seqs = [Sequence(torch.tensor([9, 9, 8, 5, 5, 5, 7]), 3, 0.0, "raw")]  # generated: 5 5 5 7; prompt 9 9 8
    ids, stats = draft_vocabulary(seqs, 12, 4)
    assert ids.tolist() == [5, 7, 8, 9]
    assert stats["train_coverage"] == 1.0
    ids, _ = draft_vocabulary(seqs, 12, 6)  # then by id
    assert ids.tolist() == [0, 1, 5, 7, 8, 9]


# ---- dense forward == paged forward --------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_dense_forward_equals_paged_forward_with_recursion(tiny_model_dir, arch):
    main = load_ember_model(tiny_model_dir(arch))
    mtp = MTPModule(main, 1, "deepseek", draft_vocab_sizes=[200])
    randomize(mtp)
    mtp.layers[0].draft_vocab = torch.randperm(main.cfg.vocab_size, generator=torch.Generator().manual_seed(1))[:200]
    H, B, T = main.cfg.hidden_size, 2, 9
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, main.cfg.vocab_size, (B, T), generator=g) for _ in range(3)]
    hid = torch.randn(B, T, H, generator=g)
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        g0, kv0 = mtp.forward_dense(ids[0], pos, hid)
        g1, kv1 = mtp.forward_dense(ids[1], pos + 1, g0, step=1, prior_kv=(*kv0, []))
        g2, _ = mtp.forward_dense(ids[2], pos + 2, g1, step=2, prior_kv=(*kv0, [kv1]))
    # paged: for each start t, step 0 over rows 0..t, then two recursive decode rows from t
    for b in range(B):
        for t in range(T):
            pager = MiniPager()
            cache = pager.cache(main.cfg)
            with torch.no_grad():
                y = mtp(ids[0][b, : t + 1], pos[b, : t + 1], hid[b, : t + 1], [cache], pager.meta([(0, 0, t + 1)]))
                y1 = mtp(
                    ids[1][b, t : t + 1], torch.tensor([t + 1]), y[-1:], [cache], pager.meta([(0, t + 1, 1)]), step=1
                )
                y2 = mtp(ids[2][b, t : t + 1], torch.tensor([t + 2]), y1, [cache], pager.meta([(0, t + 2, 1)]), step=2)
            torch.testing.assert_close(y[-1], g0[b, t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y1[0], g1[b, t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y2[0], g2[b, t], rtol=1e-5, atol=1e-5)


def test_dense_forward_is_differentiable(tiny_model_dir):
    main = load_ember_model(tiny_model_dir("llama"))
    mtp = build_mtp(main, torch.arange(50))
    randomize(mtp)
    for p in mtp.parameters():
        p.requires_grad_(True)
    ids = torch.randint(0, 1000, (2, 6))
    g, _ = mtp.forward_dense(ids, torch.arange(6).expand(2, 6), torch.randn(2, 6, main.cfg.hidden_size))
    mtp.layers[0].head(g).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mtp.parameters())


# ---- training ---------------------------------------------------------------------------------------------


def test_few_steps_reduce_the_loss(tiny_data, tmp_path):
    _, main, data = tiny_data
    trainer = MTPTrainer(main, data, tiny_cfg(tmp_path, max_steps=12))
    batch = data.train[:6]
    with torch.no_grad():
        before, _ = trainer.batch_loss(batch)
    history = trainer.train()
    with torch.no_grad():
        after, _ = trainer.batch_loss(batch)
    assert len(history) == 12 and trainer.step == 12
    assert after.item() < 0.8 * before.item()
    assert history[-1]["loss"] < history[0]["loss"]
    # the head only has rows for the draft vocabulary, initialised from the model's head rows
    assert trainer.mtp.layers[0].head.weight.shape == (300, main.cfg.hidden_size)


def test_resume_continues_from_the_saved_step(tiny_data, tmp_path):
    _, main, data = tiny_data
    straight = MTPTrainer(main, data, tiny_cfg(tmp_path / "a", max_steps=6))
    straight.train()
    first = MTPTrainer(main, data, tiny_cfg(tmp_path / "b", max_steps=3))
    first.train()
    assert os.path.exists(tmp_path / "b" / "ckpt" / "state.pt")
    resumed = MTPTrainer(main, data, tiny_cfg(tmp_path / "b", max_steps=6, resume=True))
    resumed.load_checkpoint()
    assert resumed.step == 3 and len(resumed.history) == 3
    resumed.train()
    assert resumed.step == 6 and [h["step"] for h in resumed.history] == [1, 2, 3, 4, 5, 6]
    for (name, a), (_, b) in zip(straight.mtp.named_parameters(), resumed.mtp.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert resumed.opt.state_dict()["state"][0]["step"] == 6
    with pytest.raises(ConfigError, match="trained with batch-tokens 256, not 512"):
        MTPTrainer(main, data, tiny_cfg(tmp_path / "b", batch_tokens=512)).load_checkpoint()


def test_written_folder_loads_with_load_mtp_and_gives_the_same_logits(tiny_data, tmp_path):
    folder, main, data = tiny_data
    trainer = MTPTrainer(main, data, tiny_cfg(tmp_path, max_steps=3))
    trainer.train()
    out = write_mtp_folder(trainer.mtp, main.cfg, str(tmp_path / "mtp"))
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaMTP"] and cfg["num_nextn_predict_layers"] == 1
    assert cfg["draft_vocab_size"] == 300
    ckpt = find_mtp_weights(main.cfg, folder, out)
    assert (ckpt.layout, ckpt.num_layers, ckpt.draft_vocab_sizes, ckpt.own_heads) == ("deepseek", 1, [300], [True])
    loaded = load_mtp(main, folder, out, progress=False)
    assert torch.equal(loaded.layers[0].draft_vocab, trainer.draft_vocab)
    # the trained module with its weights rounded to bf16 (the folder's dtype) is what was written
    ref = copy.deepcopy(trainer.mtp)
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(p.bfloat16().float())
    seqs = data.eval_greedy
    ids, hid, lens = pad_batch(seqs, 3)
    with torch.no_grad():
        for (s, g_ref), (_, g_new) in zip(chain_forward(ref, ids, hid, 2), chain_forward(loaded, ids, hid, 2)):
            torch.testing.assert_close(g_new, g_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(
                loaded.compute_logits(g_new[0], s), ref.compute_logits(g_ref[0], s), rtol=1e-5, atol=1e-5
            )
    # and through the paged path the engine uses
    s = seqs[0]
    pager = MiniPager(num_blocks=64)
    with torch.no_grad():
        y = loaded(
            s.ids[1:],
            torch.arange(len(s) - 1),
            s.hidden[:-1],
            [pager.cache(main.cfg, num_blocks=64)],
            pager.meta([(0, 0, len(s) - 1)]),
        )
        g_ref, _ = ref.forward_dense(s.ids[None, 1:], torch.arange(len(s) - 1)[None], s.hidden[None, :-1])
    torch.testing.assert_close(y, g_ref[0], rtol=1e-5, atol=1e-5)


def test_reduced_vocab_head_only_proposes_draft_tokens(tiny_model_dir):
    main = load_ember_model(tiny_model_dir("qwen3"))
    dv = torch.randperm(main.cfg.vocab_size, generator=torch.Generator().manual_seed(4))[:64].sort().values
    mtp = build_mtp(main, dv)
    randomize(mtp, seed=5)
    g = torch.randn(200, main.cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = mtp.compute_logits(g)
        small, ids = mtp.compute_draft_logits(g)
    assert full.shape == (200, main.cfg.vocab_size) and small.shape == (200, 64) and torch.equal(ids, dv)
    outside = torch.ones(main.cfg.vocab_size, dtype=torch.bool)
    outside[dv] = False
    assert torch.isneginf(full[:, outside]).all() and torch.isfinite(full[:, dv]).all()
    assert set(full.argmax(-1).tolist()) <= set(dv.tolist())
    assert torch.equal(mtp.propose_greedy(g), full.argmax(-1))
    sampled = torch.multinomial(
        torch.softmax(full, -1), 20, replacement=True, generator=torch.Generator().manual_seed(7)
    )
    assert set(sampled.flatten().tolist()) <= set(dv.tolist())


def test_draft_vocab_without_own_head_uses_model_head_rows_and_bad_ones_are_refused(tiny_model_dir, tmp_path):
    from safetensors.torch import save_file

    folder = tiny_model_dir("qwen3")
    main = load_ember_model(folder)
    dv = torch.tensor([3, 10, 42, 77, 500])
    mtp = build_mtp(main, dv)
    randomize(mtp)
    tensors = export_deepseek_tensors(mtp, main.cfg.num_layers)
    del tensors["model.layers.2.shared_head.head.weight"]
    out = tmp_path / "mtp"
    out.mkdir()
    with open(out / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen3MTP"], "num_nextn_predict_layers": 1}, f)
    save_file(tensors, str(out / "model.safetensors"))
    loaded = load_mtp(main, folder, str(out), progress=False)
    torch.testing.assert_close(loaded.layers[0].head.weight, main.lm_head.weight[dv])
    for bad, message in (
        (torch.tensor([3, 3, 4, 5, 6]), "repeats token ids"),
        (torch.tensor([3, 4, 5, 6, 5000]), "outside 0..999"),
        (torch.tensor([1.0, 2, 3, 4, 5]), "1-D integer tensor"),
    ):
        save_file({**tensors, "model.layers.2.shared_head.draft_vocab": bad}, str(out / "model.safetensors"))
        with pytest.raises(ModelLoadError, match=message):
            load_mtp(main, folder, str(out), progress=False)
    tensors["model.layers.2.shared_head.head.weight"] = torch.zeros(7, main.cfg.hidden_size)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lists 5 token ids but .* has 7 rows"):
        load_mtp(main, folder, str(out), progress=False)


# ---- the command --------------------------------------------------------------------------------------------


@pytest.mark.engine
def test_cli_writes_a_loadable_folder_with_a_readme_and_resumes(tiny_model_dir, tmp_path):
    from ember.entrypoints.cli import main as cli_main

    folder = tiny_model_dir("llama")
    out, ck = str(tmp_path / "out"), str(tmp_path / "ck")
    common = [
        folder,
        "--out",
        out,
        "--checkpoint-dir",
        ck,
        "--num-prompts",
        "6",
        "--max-new-tokens",
        "12",
        "--eval-prompts",
        "2",
        "--draft-vocab-size",
        "200",
        "--batch-tokens",
        "256",
        "--threads",
        "1",
        "--depth",
        "2",
        "--epochs",
        "2",
    ]
    assert cli_main(["train-mtp", *common, "--resume"]) == 2  # nothing to resume yet
    assert cli_main(["train-mtp", *common, "--max-steps", "2"]) == 0
    assert sorted(os.listdir(out)) == ["README.md", "config.json", "model.safetensors"]
    state = torch.load(os.path.join(ck, "state.pt"), weights_only=False)
    assert state["step"] == 2
    assert cli_main(["train-mtp", *common, "--resume"]) == 0  # reuses data.pt, continues to the end
    state = torch.load(os.path.join(ck, "state.pt"), weights_only=False)
    assert state["step"] > 2 and state["history"][2]["step"] == 3
    readme = open(os.path.join(out, "README.md")).read()
    assert "ember train-mtp" in readme and "--resume" in readme and "| 1 |" in readme
    main = load_ember_model(folder)
    assert load_mtp(main, folder, out, progress=False).layers[0].draft_vocab.numel() == 200


# ---- the committed folder for the default model ----------------------------------------------------------------


@pytest.mark.slow
def test_committed_default_model_mtp_loads_and_drafts(tmp_path):
    from ember.default_model import default_model_path
    from ember.loader.model_loader import load_model
    from ember.train.mtp_data import prefill_meta

    assert os.path.exists(os.path.join(ASSET, "model.safetensors")), "ember/assets/smollm2-mtp is missing"
    with open(os.path.join(ASSET, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaMTP"] and cfg["num_nextn_predict_layers"] == 1
    assert os.path.getsize(os.path.join(ASSET, "model.safetensors")) < 25e6
    path = default_model_path()
    loaded = load_model(path, None, torch.float32, torch.device("cpu"), "torch", "none")
    main, tok = loaded.model, loaded.tokenizer
    mtp = load_mtp(main, path, ASSET, progress=False)
    dv = mtp.layers[0].draft_vocab
    assert dv is not None and dv.numel() == cfg["draft_vocab_size"] and mtp.layers[0].head.weight.shape[0] == dv.numel()
    # a trained draft: on held-out text, the MTP's draft at position i often is the model's token at i + 2
    from ember.train.calibration import pydoc_split

    ids = torch.tensor(tok.encode(pydoc_split("eval")[3][:1200]))[:160]
    L = len(ids)
    attn = main.model.layers[0].self_attn.attn
    caches = [torch.zeros(2, 1, L, attn.num_kv_heads, attn.head_dim) for _ in range(main.cfg.num_layers)]
    with torch.no_grad():
        h = main(ids, torch.arange(L), caches, prefill_meta([L]))
        greedy = main.compute_logits(h).argmax(-1)
        g, _ = mtp.forward_dense(ids[None, 1:], torch.arange(L - 1)[None], h[None, :-1])
        drafts = mtp.propose_greedy(g[0])
    agree = (drafts[:-1] == greedy[1:-1]).float().mean().item()
    assert set(drafts.tolist()) <= set(dv.tolist())
    assert agree > 0.3, f"draft agrees with the model's next-next token on {agree:.2f} of the positions"
