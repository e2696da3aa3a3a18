"""`ember train-mtp` for a model with its own kind of MTP layer (qwen4_exp, Qwen4ExpMTP): the training
forward (forward_dense) against the engine's paged forward of the same layer, chained draft steps
included; the gradient reaching every trained parameter; and a training run on the tiny qwen4_exp whose
held-out acceptance is far above chance, served by the engine with exactly the plain greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.models.tiny_models import load_ember_model, one_thread  # noqa: F401
from tests.models.tiny_qwen4 import build_qwen4, save_qwen4
from tests.spec.mtp_fixtures import MiniPager

pytestmark = pytest.mark.usefixtures("one_thread")


def perturb(mtp, seed: int = 0) -> None:
    """init_from_main's start moved off (its fusion is an identity, its norms zero): every path exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in mtp.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g) * p.float().std().clamp_min(0.5))


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    path = save_qwen4(build_qwen4(), str(tmp_path_factory.mktemp("qwen4-train-mtp")))
    return load_ember_model(path)


@pytest.fixture(scope="module")
def mtp(main):
    layer = main.build_mtp(1)
    layer.init_from_main(main)
    perturb(layer)
    return layer.eval()


def test_dense_forward_equals_paged_forward_with_recursion(main, mtp):
    """Step 0 over rows 0..t, then two recursive decode rows from t, through the paged cache (the engine's
    forward), equal forward_dense's rows t of steps 0, 1, 2 (below the QSA dense threshold)."""
    B, T, width = 2, 9, main.cfg.hc_count * main.cfg.hidden_size
    assert T + 2 <= main.cfg.indexer.dense_below
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, main.cfg.vocab_size, (B, T), generator=g) for _ in range(3)]
    hid = torch.randn(B, T, width, generator=g)
    pos = torch.arange(T).expand(B, T)
    with torch.no_grad():
        g0, kv0 = mtp.forward_dense(ids[0], pos, hid)
        g1, kv1 = mtp.forward_dense(ids[1], pos + 1, g0, step=1, prior_kv=(*kv0, []))
        g2, _ = mtp.forward_dense(ids[2], pos + 2, g1, step=2, prior_kv=(*kv0, [kv1]))
    cfg = main.cfg
    for b in range(B):
        for t in range(T):
            pager = MiniPager()
            cache = torch.randn(2, 32, pager.block_size, cfg.num_kv_heads, cfg.head_dim)
            with torch.no_grad():
                y = mtp(ids[0][b, : t + 1], pos[b, : t + 1], hid[b, : t + 1], [cache], pager.meta([(0, 0, t + 1)]))
                y1 = mtp(
                    ids[1][b, t : t + 1], torch.tensor([t + 1]), y[-1:], [cache], pager.meta([(0, t + 1, 1)]), step=1
                )
                y2 = mtp(ids[2][b, t : t + 1], torch.tensor([t + 2]), y1, [cache], pager.meta([(0, t + 2, 1)]), step=2)
            torch.testing.assert_close(y[-1], g0[b, t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y1[0], g1[b, t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y2[0], g2[b, t], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mtp.compute_logits(y2[:1]), mtp.compute_logits(g2[b, t : t + 1]))


@pytest.mark.parametrize("lens", [(90, 40), (20, 7)])
def test_a_fill_runs_past_the_attention_for_its_selected_rows_only(main, mtp, lens):
    """The fill (a selection: the rows that draft next) writes every row's K/V and indexer key as the whole
    layer does, and its kept rows equal the whole layer's; past the QSA dense threshold (90) and below it.
    With nothing kept, the K/V and keys are written all the same."""
    from ember.kernels.metadata import RowSelection

    cfg, width = main.cfg, main.cfg.hc_count * main.cfg.hidden_size
    pager = MiniPager(num_blocks=64)
    meta = pager.meta([(s, 0, n) for s, n in enumerate(lens)])
    g = torch.Generator().manual_seed(4)
    T = sum(lens)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    pos = torch.cat([torch.arange(n) for n in lens])
    hid = torch.randn(T, width, generator=g)
    indexer = mtp.layers[0].self_attn.indexer
    outs = []
    for select in (None, pager.last_rows(meta, pos), RowSelection(torch.empty(0, dtype=torch.int64), None)):
        cache = pager.cache(cfg, 64)
        indexer.keys = None
        with torch.no_grad():
            y = mtp(ids, pos, hid, [cache], meta, select=select)
        outs.append((select, y, cache, indexer.keys.clone()))
    (_, whole, cache, keys), (select, kept, cache1, keys1), (_, none, cache2, keys2) = outs
    torch.testing.assert_close(kept, whole[select.rows], rtol=1e-5, atol=1e-5)
    assert none.shape == (0, width)
    for c, k in ((cache1, keys1), (cache2, keys2)):
        assert torch.equal(c, cache) and torch.equal(k, keys)


def test_gradient_reaches_every_trained_parameter(main):
    """Through two chained steps and the model's head: every parameter but the QSA indexer's (it only
    selects keys past the dense threshold, which the dense training forward never reaches: kept as copied)."""
    layer = main.build_mtp(1)
    layer.init_from_main(main)
    perturb(layer, seed=1)
    layer.float().requires_grad_(True)
    B, T = 2, 12
    ids = torch.randint(0, main.cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(T).expand(B, T)
    g0, kv0 = layer.forward_dense(ids, pos, torch.randn(B, T, main.cfg.hc_count * main.cfg.hidden_size))
    g1, _ = layer.forward_dense(ids, pos + 1, g0, step=1, prior_kv=(*kv0, []))
    layer.compute_draft_logits(g1)[0].logsumexp(-1).sum().backward()
    for name, p in layer.named_parameters():
        reached = p.grad is not None and bool(p.grad.abs().sum() > 0)
        assert reached == (".indexer." not in name), name
    assert all(p.grad is None for p in main.parameters())  # the model stays frozen


# ---- training on the tiny qwen4_exp ------------------------------------------------------------------------

CHANCE = 1 / 512  # the vocabulary
TRAIN = dict(num_prompts=24, max_new_tokens=40, eval_prompts=6, epochs=10, lr=1e-2, depth=2)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """train_mtp on build_qwen4_predictable (its docstring: why not build_qwen4); the held-out acceptance of
    the untrained start (init_from_main) measured on the same data."""
    from ember.train.mtp import TrainConfig, _load_or_make_data, evaluate_mtp, train_mtp
    from tests.models.tiny_qwen4 import build_qwen4_predictable

    root = tmp_path_factory.mktemp("qwen4-mtp-trained")
    path = save_qwen4(build_qwen4_predictable(), str(root / "model"))
    cfg = TrainConfig(
        model=path,
        out=str(root / "mtp"),
        draft_vocab_size=0,
        batch_tokens=1024,
        save_every=0,
        progress=False,
        train_dtype="float32",
        engine_knobs={"kv_cache_memory": 0.02, "dtype": "float32", "executor": "eager"},
        **TRAIN,
    )
    report = train_mtp(cfg, command="test")
    data, model, _ = _load_or_make_data(cfg, path)  # the data train_mtp generated, from its checkpoint
    start = model.build_mtp(1)
    start.init_from_main(model)
    before = evaluate_mtp(start, model, data, depth=2)
    return path, cfg.out, data, report, before


@pytest.mark.engine
def test_trained_mtp_accepts_far_above_chance(trained):
    """Held-out greedy acceptance of the folder as served (bf16 weights): measured 0.17 before training
    (init_from_main), 0.56 after (0.04 -> 0.38 for drafts 1 and 2 both accepted); chance is 1/512."""
    _, _, _, report, before = trained
    acc, start = report["acceptance"], before["acceptance"]
    assert report["positions"] > 100 and report["steps"] > 0
    assert acc[0] > 0.35 and acc[0] > 100 * CHANCE, (acc, start)
    assert acc[0] > start[0] + 0.2, (acc, start)  # learned: far above where it started
    assert acc[1] > start[1] + 0.1, (acc, start)  # the chained second draft too (trained at depth 2)


@pytest.mark.engine
def test_trained_folder_serves_the_plain_greedy_tokens_accepting_drafts(trained):
    from ember import LLM, SamplingParams

    path, folder, data, _, _ = trained
    prompts = [{"prompt_token_ids": s.ids[: s.prompt_len].tolist()} for s in data.eval_greedy[:4]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    knobs = dict(dtype="float32", executor="eager", kv_cache_memory=0.02, max_num_seqs=4)
    plain = LLM(path, **knobs).generate(prompts, params, use_tqdm=False)
    spec = LLM(
        path,
        speculative_config={"method": "mtp", "model": folder, "num_speculative_tokens": 2},
        adaptive_spec=False,
        **knobs,
    )
    outs = spec.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    stats = spec.engine.stats()
    assert stats["spec_num_drafts"] > 0, stats
    assert stats["spec_num_accepted_tokens"] > 0.25 * stats["spec_num_draft_tokens"], stats
    assert stats["spec_mean_accepted_length"] > 1.3, stats
