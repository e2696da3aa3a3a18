"""qwen4_exp (ember.models.qwen4_exp) against transformers' reference on a tiny random model: greedy tokens
identical and first-token logprobs within 1e-4, short prompts (QSA exactly dense) and 200-token ones (QSA
drops blocks: asserted), with EOS inside the prompt (PLE's n-gram restart), chunked prefill that cuts the
PLE conv window and QSA blocks, batching, and prefix-cache hits; plus the PLE hash against the release's
published constants."""

from __future__ import annotations

import pytest
import torch

from ember import LLM, SamplingParams
from ember.layers.table_rows import TensorRows
from tests.models.tiny_models import hf_greedy, one_thread  # noqa: F401
from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]
GEN = 10
PROMPTS = [
    prompt(40, 1),
    prompt(200, 2, eos_at=(20, 21, 77, 130)),
    prompt(131, 3, eos_at=(0, 1, 4)),
    prompt(9, 4),
    prompt(50, 5, eos_at=(48,)),  # the last token's trigram reads EOS, not the token before it
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = build_qwen4()
    path = save_qwen4(hf, str(tmp_path_factory.mktemp("qwen4")))
    return hf, path, [hf_greedy(hf, p, GEN) for p in PROMPTS]


def llm(path, **kw):
    args = dict(dtype="float32", executor="eager", max_model_len=512, kv_cache_memory=0.05, max_num_seqs=4)
    return LLM(path, **(args | kw))


def first_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)


@pytest.mark.parametrize("chunk", [512, 37, 7])
def test_greedy_tokens_and_logprobs_equal_transformers(tiny, chunk):
    hf, path, refs = tiny
    engine = llm(path, max_num_batched_tokens=chunk)
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True, logprobs=5)
    for p, ref in zip(PROMPTS, refs):  # one at a time: the later ones find the earlier ones' prefixes
        out = engine.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
        assert out.token_ids == ref, (len(p), chunk)
        theirs = first_logprobs(hf, p)
        assert max(abs(lp.logprob - theirs[t].item()) for t, lp in out.logprobs[0].items()) < 1e-4
    batched = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == refs


def test_long_prompts_are_sparse(tiny, monkeypatch):
    """The 200-token prompt's last queries keep 16 of their 50 blocks (and the tail): QSA selected, through the
    C++ selected-block kernel (the path the parity test above took), and the tokens above matched the
    reference through it."""
    from ember.kernels import cpu_qsa_attention

    hf, path, _ = tiny
    engine = llm(path)
    attn = next(layer.self_attn for layer in engine.engine.parts.runner.model.model.layers if not layer.is_linear)
    seen, kernel_rows = [], []
    select, kernel = attn.indexer.select_blocks, cpu_qsa_attention.qsa_attention

    def spy(q, meta, cos_sin):
        sel = select(q, meta, cos_sin)
        seen.append((meta.seq_lens_cpu[0], sel.mask(meta.seq_lens_cpu[0])[-1].sum().item()))
        return sel

    def kernel_spy(q, *args):
        kernel_rows.append(q.shape[0])
        return kernel(q, *args)

    attn.indexer.select_blocks = spy
    monkeypatch.setattr(cpu_qsa_attention, "qsa_attention", kernel_spy)
    engine.generate([{"prompt_token_ids": PROMPTS[1]}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    N, kept = seen[0]
    assert N == 200 and kept == 16 * 4  # 200 = 50 whole blocks: the last query keeps its top 16 blocks
    assert attn.indexer.cfg.dense_below == 67
    assert attn.cpu_kernel and kernel_rows[0] == 200 and kernel_rows[-1] == 1  # the prefill, then a decode


def test_the_vision_language_layout_serves_its_text_model(tmp_path):
    """Qwen4ExpForConditionalGeneration as released: text weights under model.language_model.*, a vision
    tower beside them, config under text_config; ember serves the text model, the tower left unloaded."""
    from tests.models.tiny_qwen4 import build_qwen4_vl

    hf = build_qwen4_vl()
    path = save_qwen4(hf, str(tmp_path / "vl"))
    engine = llm(path)
    assert engine.engine.parts.loaded.model_config.architecture == "Qwen4ExpForConditionalGeneration"
    p = prompt(80, 3, eos_at=(40,))
    out = engine.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(hf, p, 8)


def test_ngram_hash_has_the_release_constants():
    """The release (vocab 248320, seed 1234, N 3, 8 heads a gram, base 20M): the multipliers and head sizes
    ../shared/research/qwen4exp.md derived and the checkpoint's int64 buffers hold."""
    from ember.config.model_config import PLEConfig
    from ember.layers.ple import NGramHash

    cfg = PLEConfig((1,), 2560, 4, 3, 8, 20_000_000, 128, 1234, 248044)
    h = NGramHash(cfg, 248320, 0)
    assert h.multipliers == [23703573157769, 20109073645365, 8052911324071]
    assert h.sizes[:4] == [20000003, 20000023, 20000033, 20000047] and h.sizes[-1] == 20000171
    assert h.num_rows == 320_001_536


def test_ngram_rows_are_transformers_rows():
    """Each row id as transformers' n-gram embedding computes it (its table's row i holds i), EOS restarts
    inside the ids, and from a carried context of ids."""
    import transformers
    from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextNGramEmbedding

    from ember.config.model_config import ModelConfig
    from tests.models.tiny_qwen4 import CONFIG

    ref = Qwen4ExpTextNGramEmbedding(transformers.Qwen4ExpTextConfig(**CONFIG), 64, layer_idx=2)
    with torch.no_grad():
        ref.ngram_embedding.weight.copy_(torch.arange(ref.ngram_embedding.weight.shape[0])[:, None].float())
    from ember.layers.ple import NGramHash

    ours = NGramHash(ModelConfig.from_dict(CONFIG | {"architectures": ["Qwen4ExpForCausalLM"]}).ple, 512, 0)
    ids = torch.tensor(prompt(60, 9, eos_at=(0, 5, 6, 30, 59)))
    with torch.no_grad():
        theirs = ref(ids[None], None).view(60, -1, ref.ngram_embedding.weight.shape[1])[..., 0].long()
    assert torch.equal(ours.rows(torch.cat([torch.full((2,), 1), ids])), theirs)


def test_ngram_rows_chunked_equal_whole():
    """The carried ids (the last N - 1) make any cut give the rows of the whole, EOS resets included."""
    from ember.config.model_config import PLEConfig
    from ember.layers.ple import NGramHash

    h = NGramHash(PLEConfig((2,), 64, 4, 3, 2, 1000, 128, 1234, 1), 512, 0)
    ids = torch.tensor(prompt(50, 7, eos_at=(3, 10, 11, 30)))
    start = torch.full((2,), 1)
    whole = h.rows(torch.cat([start, ids]))
    for cut in (1, 2, 3, 11, 12, 31):
        a = h.rows(torch.cat([start, ids[:cut]]))
        b = h.rows(torch.cat([torch.cat([start, ids])[cut : cut + 2], ids[cut:]]))
        assert torch.equal(torch.cat([a, b]), whole), cut


def test_config_reads_the_spellings_in_the_wild_and_names_what_breaks_it():
    import copy

    from ember.config.model_config import FULL_ATTENTION, ModelConfig
    from ember.errors import ModelLoadError
    from tests.models.tiny_qwen4 import CONFIG

    def cfg(**changes):
        raw = copy.deepcopy(CONFIG) | {"architectures": ["Qwen4ExpForCausalLM"]} | changes
        return ModelConfig.from_dict(raw)

    for spelling in ("full_attention", "indexed_attention", "qwen_sparse_attention"):
        mc = cfg(layer_types=["linear_attention", spelling, "linear_attention", spelling])
        assert mc.layer_types[1] == FULL_ATTENTION and mc.num_kv_layers == 2
    mc = cfg(eos_token_id=[7, 1])
    assert mc.ple.layers == (2,) and mc.ple.eos_token_id == 7 and mc.output_gate_type == "sigmoid"
    assert mc.indexer.dense_below == 67 and mc.hc_count == 4
    with pytest.raises(ModelLoadError, match="ple_layer_ids"):
        cfg(ple_layer_ids=[2])  # 1-based: layer 1 is an attention layer
    with pytest.raises(ModelLoadError, match="indexer_head_dim"):
        cfg(indexer_head_dim=None)
    with pytest.raises(ModelLoadError, match="eos_token_id"):
        cfg(eos_token_id=None)
    vl = ModelConfig.from_dict(
        {"architectures": ["Qwen4ExpForConditionalGeneration"], "text_config": copy.deepcopy(CONFIG)}
    )
    assert vl.hc_count == 4 and vl.traits.vision_language


def test_a_verify_keeps_the_ple_state_of_its_accepted_tokens():
    """A verify's PLE state (conv window and ids) after a accepted drafts equals a prefill's after the same
    tokens, and its rows equal the rows of one prefill of them all (PLEState.keep_ple_verify, commit)."""
    from types import SimpleNamespace

    from ember.config.model_config import ModelConfig
    from ember.layers.ple import PLELayer
    from tests.models.tiny_qwen4 import CONFIG

    cfg = ModelConfig.from_dict(CONFIG | {"architectures": ["Qwen4ExpForCausalLM"]}).ple
    torch.manual_seed(0)
    layer = PLELayer(cfg, 512, 64, 4, 1e-6, 0, torch.float32, "cpu")
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    layer.table.add_shard(0, TensorRows(torch.randn(layer.hash.num_rows, layer.table.dim)), 1)
    state = layer.make_state((8, 4, 1, 2, 2, torch.float32, "cpu"), 3)
    X, ids = torch.randn(9, 256), torch.tensor(prompt(9, 5, eos_at=(3,)))

    def step(rows: slice, slot: int, has: bool, drafts: int = 0):
        n = rows.stop - rows.start
        rec = SimpleNamespace(slots=[slot], has_state=[has], num_drafts=[drafts], snapshots=[[]])
        return layer(X[rows], ids[rows], state, SimpleNamespace(query_lens_cpu=[n], recurrent=rec, fixed_shape=False))

    whole = step(slice(0, 9), 2, False)
    step(slice(0, 5), 0, False)
    verify = step(slice(5, 9), 0, True, drafts=3)  # the last sampled token and 3 drafts
    assert torch.allclose(verify, whole[5:], atol=1e-5)
    state.commit({0: 1})  # one draft accepted: the state after tokens 0..6
    step(slice(0, 7), 1, False)
    assert torch.equal(state.ple_ids[0], state.ple_ids[1]) and state.ple_ids[0].tolist() == ids[5:7].tolist()
    assert torch.allclose(state.ple_window[0], state.ple_window[1], atol=1e-6)


def test_plan_counts_the_weights_the_loader_holds(tiny):
    """ember plan's weights for qwen4_exp (mixers, indexers, PLE and its table) against the loaded model's."""
    from ember.config import EngineConfig
    from ember.engine.planner import plan

    _, path, _ = tiny
    planned = plan(EngineConfig(model=path, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory=0.05))
    loaded = llm(path).engine.parts.loaded.weight_bytes
    assert abs(planned.weight_bytes - loaded) <= 0.01 * loaded, (planned.weight_bytes, loaded)


def test_an_fp8_kv_cache_is_refused_at_start(tiny):
    from ember.errors import ConfigError

    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8"):
        llm(tiny[1], kv_cache_dtype="fp8")


def test_tied_block_scores_at_the_cut_are_broken_as_the_reference_breaks_them(tmp_path):
    """A one-head-a-gram model whose indexer often scores blocks exactly 0 (ReLU of all-negative heads): at
    97 tokens some queries' k-th and (k+1)-th visible blocks tie at the budget's cut, and the kept set is the
    reference's (torch.topk over that query's visible blocks); a batched top-k over padded rows kept other
    blocks and moved the logprobs by 1.4e-4."""
    from ember.kernels import cpu_qsa_scoring
    from ember.layers import qsa

    hf = build_qwen4(ngram_size=4, heads_per_ngram=1, ple_conv_kernel_size=2, ple_embed_dim=48)
    path = save_qwen4(hf, str(tmp_path))
    p = prompt(97, 30)
    found = []
    real, real_select = qsa.boundary_ties, cpu_qsa_scoring.select_blocks

    def spy(scores, nc, k):
        found.append(len(real(scores, nc, k)))
        return real(scores, nc, k)

    def spy_select(q, keys, seq_idx, nc, k):  # the C++ scoring's rows (CpuKernels.qsa_scoring): the same count
        spy(cpu_qsa_scoring.block_scores(q, keys, seq_idx, nc), nc, k)
        return real_select(q, keys, seq_idx, nc, k)

    qsa.boundary_ties, cpu_qsa_scoring.select_blocks = spy, spy_select
    try:
        out = (
            llm(path)
            .generate(
                [{"prompt_token_ids": p}],
                SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5),
                use_tqdm=False,
            )[0]
            .outputs[0]
        )
    finally:
        qsa.boundary_ties, cpu_qsa_scoring.select_blocks = real, real_select
    assert sum(found) > 0
    assert out.token_ids == hf_greedy(hf, p, 4)
    theirs = first_logprobs(hf, p)
    assert max(abs(lp.logprob - theirs[t].item()) for t, lp in out.logprobs[0].items()) < 1e-5


@pytest.fixture(scope="module")
def tiny8(tmp_path_factory):
    """Blocks of 8 tokens over pages of 4: a prefix hit ends in the middle of a QSA block."""
    hf = build_qwen4(seed=3, indexer_budget=32, indexer_compress_ratio=8)
    return hf, save_qwen4(hf, str(tmp_path_factory.mktemp("qwen4-r8")))


def test_prefix_hits_mid_block_and_after_an_eos_give_the_reference_tokens(tiny8):
    """Hits where hybrid prefix caching resumes, each inside an 8-token QSA block and after EOS tokens in
    the prompt: the same prompt again (the snapshot at P - 1 = 162), and the next chat turn (the state after
    A's 173 computed tokens, EOS among its last prompt tokens). Tokens equal transformers'."""
    hf, path = tiny8
    a = prompt(163, 40, eos_at=(60, 127, 161))
    engine = llm(path, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)
    first = engine.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0].outputs[0].token_ids
    again = engine.generate([{"prompt_token_ids": a}], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 162 and again.outputs[0].token_ids == first == hf_greedy(hf, a, GEN)
    b = a + first + prompt(21, 41, eos_at=(0,))
    turn = engine.generate([{"prompt_token_ids": b}], params, use_tqdm=False)[0]
    assert turn.num_cached_tokens == 172 and 172 % 8
    assert turn.outputs[0].token_ids == hf_greedy(hf, b, GEN)


def test_preempted_requests_give_the_reference_tokens(tiny8):
    """Four 24-token prompts admitted together, each growing to 64 tokens in a pool of 160:
    requests are preempted, recomputed (past the dense threshold), and give transformers' tokens; every
    block and state slot comes back."""
    from ember.config.model_config import ModelConfig
    from ember.engine.planner import kv_bytes_per_token

    hf, path = tiny8
    mc = ModelConfig.from_folder(path)
    states = mc.state_bytes_per_seq(4) * (4 + 8)
    kv = 40 * 4 * kv_bytes_per_token(mc, 4)  # 40 pages of 4 tokens
    engine = llm(path, block_size=4, kv_cache_memory=(states + kv) / 2**30, max_model_len=80)
    prompts = [prompt(24, 50 + i, eos_at=(5 * i,)) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 40) for p in prompts]
    parts = engine.engine.parts
    assert parts.scheduler.num_preemptions > 0
    assert parts.kv.states.num_free == parts.kv.states.num_live
    assert parts.kv.num_free_blocks == parts.kv.num_blocks
