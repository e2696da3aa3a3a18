"""The engine end to end on tiny random models: batching, chunking, prefix cache and preemption
never change greedy tokens; blocks come back; bad input gets ember errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.config.model_config import ModelConfig
from ember.errors import ConfigError, KVCacheTooSmallError, ModelLoadError, PromptTooLongError
from tests.models.tiny_models import build_hf_model, hf_greedy, random_prompt

pytestmark = pytest.mark.engine  # every test here builds an engine

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
LENGTHS = [5, 17, 3, 40, 9, 26, 1, 12]


def kv_gib(path: str, blocks: int, block_size: int) -> float:
    cfg = ModelConfig.from_folder(path)
    return blocks * block_size * cfg.kv_bytes_per_token_per_dtype_byte * 4 / 2**30  # fp32


def make_llm(path, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("block_size", 4)
    kw.setdefault("max_model_len", 128)
    kw.setdefault("num_threads", 1)  # tiny models: threading costs more than it gives
    kw.setdefault("kv_cache_memory", kv_gib(path, 512, kw["block_size"]))  # small pool: fast to allocate
    return LLM(path, **kw)


def greedy(llm, prompts, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def qwen3(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, seed) for seed, n in enumerate(LENGTHS)]


def test_engine_matches_hf_greedy_32_tokens(tiny_model_dir):
    for arch in ("llama", "qwen3_moe"):
        path = tiny_model_dir(arch)
        hf = build_hf_model(arch)
        llm = make_llm(path)
        prompt = random_prompt(11, 99)
        ours = greedy(llm, [prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        assert ours == hf_greedy(hf, prompt, 32), arch


def test_cpu_paged_attention_knob_switches_the_kernel_and_keeps_greedy_tokens(qwen3, prompts, monkeypatch):
    """--no-cpu-paged-attention runs decodes through the torch path; greedy output is the same."""
    import ember.kernels.cpu_attention as ta

    calls = []
    real = ta.paged_attention
    monkeypatch.setattr(ta, "paged_attention", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    on, off = make_llm(qwen3, max_num_seqs=8), make_llm(qwen3, max_num_seqs=8, cpu_paged_attention=False)
    with_kernel = greedy(on, prompts)
    assert calls, "the fused kernel did not run"
    calls.clear()
    assert greedy(off, prompts) == with_kernel and not calls


def test_batched_equals_alone(qwen3, prompts):
    llm = make_llm(qwen3, enable_prefix_caching=False, max_num_seqs=8)
    batched = greedy(llm, prompts)
    for p, b in zip(prompts, batched):
        assert greedy(llm, [p]) == [b]


def test_chunked_prefill_with_7_token_budget_equals_unchunked(qwen3, prompts):
    small = make_llm(qwen3, max_num_batched_tokens=7, max_num_seqs=4, enable_prefix_caching=False)
    big = make_llm(qwen3, enable_prefix_caching=False)
    assert greedy(small, prompts) == greedy(big, prompts)


def test_prefix_cache_hit_equals_cold(qwen3):
    shared = random_prompt(32, 7)
    first, second = shared + random_prompt(8, 8), shared + random_prompt(9, 9)
    warm = make_llm(qwen3)
    greedy(warm, [first])
    out = warm.generate([{"prompt_token_ids": second}], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 32  # 8 full blocks of 4: only the 9 new tokens were computed
    assert warm.engine.parts.kv.stats.hits >= 32
    cold = make_llm(qwen3, enable_prefix_caching=False)
    assert out.outputs[0].token_ids == greedy(cold, [second])[0]


def test_preemption_under_a_tiny_pool_equals_ample_pool(qwen3, prompts):
    # 20 blocks of 4 = 80 tokens for 8 requests of up to 40 + 16 tokens: preemption must happen.
    tiny = make_llm(
        qwen3, kv_cache_memory=kv_gib(qwen3, 20, 4), max_model_len=64, max_num_seqs=8, enable_prefix_caching=False
    )
    assert tiny.engine.parts.kv.num_blocks == 20
    out_tiny = greedy(tiny, prompts)
    assert tiny.engine.parts.scheduler.num_preemptions > 0
    ample = make_llm(qwen3, enable_prefix_caching=False)
    assert out_tiny == greedy(ample, prompts)
    assert tiny.engine.parts.kv.num_free_blocks == 20


def test_all_blocks_return_after_finish_and_abort(qwen3, prompts):
    llm = make_llm(qwen3)
    eng = llm.engine
    total = eng.parts.kv.num_blocks
    greedy(llm, prompts)
    assert eng.parts.kv.num_free_blocks == total
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", {"prompt_token_ids": p}, GREEDY)
    for _ in range(3):
        eng.step()
    assert eng.parts.kv.num_free_blocks < total
    for i in range(len(prompts)):
        assert eng.abort_request(f"r{i}")
    assert not eng.has_unfinished_requests()
    assert eng.parts.kv.num_free_blocks == total
    assert eng.parts.scheduler.num_unfinished == 0


def test_stop_string_across_tokens_is_cut(qwen3):
    llm = make_llm(qwen3)
    prompt = {"prompt_token_ids": random_prompt(6, 3)}
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    text = full.text
    tok = llm.get_tokenizer()
    # A stop string that starts inside one token's text and ends inside a later one.
    pieces = [tok.decode([t]) for t in full.token_ids]
    start = len(pieces[0]) + len(pieces[1]) - 1
    stop = text[start : start + len(pieces[2]) + 2]
    assert len(stop) >= 3
    cut = text.index(stop)
    out = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert out.text == text[:cut]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    kept = llm.generate(
        prompt,
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: cut + len(stop)]


def test_logprobs_match_log_softmax_of_the_reference_logits(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    hf = build_hf_model("qwen3")
    llm = make_llm(path)
    prompt = random_prompt(9, 5)
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
        use_tqdm=False,
    )[0].outputs[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt + out.token_ids])).logits[0].float(), -1)
    for i, (tid, lps) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert tid in lps and lps[tid].rank == 1
        top = row.topk(3)
        assert list(lps)[:1] == [tid]
        assert set(top.indices.tolist()) <= set(lps)
        for t, lp in lps.items():
            assert lp.logprob == pytest.approx(row[t].item(), abs=1e-4)
        assert lps[tid].decoded_token == llm.get_tokenizer().decode([tid], skip_special_tokens=False)


def test_seeded_sampling_same_text_whatever_the_batch(qwen3, prompts):
    llm = make_llm(qwen3)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.7, max_tokens=12, ignore_eos=True)] * len(prompts)
    others[3] = params
    batch = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:3] + [prompts[1]] + prompts[4:]], others, use_tqdm=False
    )
    assert batch[3].outputs[0].token_ids == alone
    other_seed = llm.generate({"prompt_token_ids": prompts[1]}, params.replace(seed=4321), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_n_completions_share_the_prompt(qwen3):
    llm = make_llm(qwen3)
    out = llm.generate(
        {"prompt_token_ids": random_prompt(10, 1)},
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.parts.kv.num_free_blocks == llm.engine.parts.kv.num_blocks


def test_text_prompts_and_chat(qwen3):
    llm = make_llm(qwen3)
    out = llm.generate(
        ["the class statement", "import os"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False
    )
    assert [o.prompt for o in out] == ["the class statement", "import os"]
    assert out[0].prompt_token_ids == llm.get_tokenizer().encode("the class statement")
    chat = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=True
    )
    assert chat[0].prompt_token_ids == ids


# -- bad input ---------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(qwen3):
    llm = make_llm(qwen3, max_model_len=32)
    with pytest.raises(PromptTooLongError, match="max_model_len is 32"):
        llm.generate({"prompt_token_ids": random_prompt(40, 0)}, GREEDY, use_tqdm=False)
    assert llm.engine.parts.kv.num_free_blocks == llm.engine.parts.kv.num_blocks  # nothing was queued


def test_max_tokens_capped_by_max_model_len(qwen3):
    llm = make_llm(qwen3, max_model_len=20)
    out = llm.generate(
        {"prompt_token_ids": random_prompt(15, 0)},
        SamplingParams(temperature=0, max_tokens=50, ignore_eos=True),
        use_tqdm=False,
    )[0]
    assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"


def test_contradictory_flags_are_refused():
    with pytest.raises(ConfigError, match="max-num-seqs"):
        EngineConfig(max_num_seqs=100, max_num_batched_tokens=10)
    with pytest.raises(ConfigError, match="chunked prefill"):
        EngineConfig(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=512)
    with pytest.raises(ConfigError, match="block-size"):
        EngineConfig(block_size=3)
    with pytest.raises(ConfigError, match="gpu-memory-utilization"):
        EngineConfig(device="cuda", kv_cache_memory=1.0)


def test_prompt_over_budget_without_chunking(qwen3):
    with pytest.raises(ConfigError, match="chunked prefill is off|chunked prefill off"):
        make_llm(qwen3, enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=256)
    llm = make_llm(qwen3, enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=None)
    with pytest.raises(PromptTooLongError, match="chunked prefill is off"):
        llm.generate({"prompt_token_ids": random_prompt(200, 0)}, GREEDY, use_tqdm=False)
    out = greedy(llm, [random_prompt(100, 0)])
    assert len(out[0]) == 16


def test_kv_cache_too_small_says_what_fits(qwen3):
    with pytest.raises(KVCacheTooSmallError, match="largest max-model-len that fits is 40"):
        make_llm(qwen3, kv_cache_memory=kv_gib(qwen3, 10, 4), max_model_len=128)


def test_unknown_architecture_and_missing_model(qwen3, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(qwen3, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="LlamaForCausalLM, Qwen2ForCausalLM"):
        make_llm(str(bad))
    with pytest.raises(ModelLoadError, match="not found"):
        LLM(str(tmp_path / "nope"))
