"""Tensor parallelism on CPU with 2 gloo ranks (rank 0 = this process, rank 1 a worker subprocess).

Tiny random Qwen3 (qk-norm), Qwen2 (q/k/v bias, tied head) and Qwen3-MoE models as in
tests/models/tiny_models.py: TP=2 must give the TP=1 greedy tokens exactly, under chunked prefill
(a 7-token budget) and batching (6 prompts at once), with top-5 logprobs within fp32 noise (only
the all-reduce's summation order differs); AWQ int4 checkpoints and MTP speculation likewise.
Then the refusals, a clean shutdown (no process left) and a killed worker (rank 0 raises, fast).
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from ember import SamplingParams
from ember.distributed import parallel_state
from ember.engine.tp import config as tp_config
from ember.errors import ConfigError, DistributedError
from tests.models.tiny_models import random_prompt
from tests.spec.spec_helpers import make_llm

# every test here builds an engine, most of them over two ranks: a core each
pytestmark = [pytest.mark.engine, pytest.mark.all_cores]

PROMPTS = [random_prompt(n, 70 + s) for s, n in enumerate([9, 23, 4, 17, 12, 30])]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
HARD = dict(max_num_batched_tokens=7, max_num_seqs=6, enable_prefix_caching=False)


def generate(llm, params=GREEDY):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def tp_llm(path, **kw):
    return make_llm(path, tensor_parallel_size=2, **kw)


def assert_same(ours, ref):
    assert [o.token_ids for o in ours] == [r.token_ids for r in ref]
    worst = 0.0
    for o, r in zip(ours, ref):
        for pos_o, pos_r in zip(o.logprobs, r.logprobs):
            assert pos_o.keys() == pos_r.keys()
            worst = max(worst, max(abs(pos_o[t].logprob - pos_r[t].logprob) for t in pos_r))
    assert worst < 1e-4, worst


def worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine.parts.tp.procs]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
def test_greedy_and_logprobs_equal_tp1(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    ref = generate(make_llm(path, **HARD))
    llm = tp_llm(path, **HARD)
    try:
        # Each rank holds half the q heads and, with 2 kv heads over 2 ranks, one kv head.
        attn = llm.engine.parts.loaded.model.model.layers[0].self_attn
        assert (attn.qkv_proj.num_heads, attn.qkv_proj.num_kv_heads) == (2, 1)
        assert llm.engine.parts.runner.kv_caches[0].shape[3] == 1
        assert_same(generate(llm), ref)
        stats = llm.engine.stats()
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
        assert llm.engine.tp_comm_seconds > 0 and stats["tp_comm_seconds_total"] >= llm.engine.tp_comm_seconds
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("arch,group", [("qwen3", 32), ("qwen3_moe", 16)])
def test_awq_int4_shards_equal_tp1(tiny_model_dir, tmp_path, arch, group):
    """AWQ qweight / qzeros / scales split along packed output columns (column-parallel) and input
    rows / groups (row-parallel, MoE down); the router stays dense."""
    from tests.quant.test_awq import write_awq_pair

    awq_dir, _ = write_awq_pair(
        tiny_model_dir(arch), str(tmp_path), group, skip=["mlp.gate"] if arch == "qwen3_moe" else ()
    )
    ref = generate(make_llm(awq_dir, **HARD))
    llm = tp_llm(awq_dir, **HARD)
    try:
        assert llm.engine.parts.loaded.quantization == "awq"
        assert_same(generate(llm), ref)
    finally:
        llm.engine.shutdown()


def test_mtp_speculation_under_tp(tiny_model_dir, tmp_path):
    """The MTP layer is sharded like the main layers and replayed on the worker: drafts (from a
    layer that predicts the bigram model exactly) are accepted and output stays greedy-identical."""
    from tests.spec.test_mtp_spec import write_bigram_model_with_mtp

    path = write_bigram_model_with_mtp(tiny_model_dir("qwen3"), str(tmp_path / "bigram"), "deepseek")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in generate(make_llm(path, **HARD), params)]
    llm = tp_llm(path, enable_mtp=True, num_speculative_tokens=3, adaptive_spec=False, **HARD)
    try:
        assert [o.token_ids for o in generate(llm, params)] == ref
        stats = llm.engine.stats()
        assert stats["spec_num_accepted_tokens"] > 0 and stats["spec_acceptance_per_pos"][2] == 1.0, stats
        assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    finally:
        llm.engine.shutdown()


def test_draft_model_runs_whole_on_rank0_under_tp(tiny_model_dir):
    """A draft model (here the target itself) is not sharded: it runs on rank 0 only, with no
    collectives, while the target runs over both ranks; every draft accepted, output unchanged."""
    path = tiny_model_dir("qwen3")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in generate(make_llm(path, **HARD), params)]
    llm = tp_llm(
        path,
        speculative_config={"method": "draft", "model": path, "num_speculative_tokens": 2},
        adaptive_spec=False,
        **HARD,
    )
    try:
        assert [o.token_ids for o in generate(llm, params)] == ref
        stats = llm.engine.stats()
        assert stats["spec_num_drafts"] > 0 and stats["spec_acceptance_per_pos"] == [1.0, 1.0], stats
        assert llm.engine.parts.spec.proposer.loaded.model.model.layers[0].mlp.down_proj.tp_size == 1
    finally:
        llm.engine.shutdown()


def test_random_mtp_layer_on_moe_keeps_greedy_output(tiny_model_dir, tmp_path):
    from tests.spec.mtp_fixtures import COUNT_KEY, checkpoint_tensors, hf_config, make_ref_layers, write_main_with_mtp

    main = tiny_model_dir("qwen3_moe")
    hf_cfg = hf_config(main)
    refs = make_ref_layers(hf_cfg, "mimo", 1, arch="qwen3_moe")
    path = write_main_with_mtp(
        main,
        str(tmp_path / "moe-mtp"),
        checkpoint_tensors(refs, "mimo", hf_cfg.num_hidden_layers, hf_cfg.moe_intermediate_size),
        {COUNT_KEY["mimo"]: 1},
    )
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in generate(make_llm(path, **HARD), params)]
    llm = tp_llm(path, enable_mtp=True, num_speculative_tokens=2, **HARD)
    try:
        assert [o.token_ids for o in generate(llm, params)] == ref
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0
    finally:
        llm.engine.shutdown()


# ---- refusals -------------------------------------------------------------------------------------


def test_head_counts_that_do_not_split_are_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(tp_config, "usable_cores", lambda: 8)
    with pytest.raises(
        ConfigError, match=r"--tensor-parallel-size 3 .*4 attention heads.*Sizes that work here: 1, 2, 4"
    ):
        make_llm(tiny_model_dir("qwen3"), tensor_parallel_size=3)
    assert parallel_state.get_state() is None  # refused before any process started


def test_more_ranks_than_cores_is_refused(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(tp_config, "usable_cores", lambda: 2)
    with pytest.raises(ConfigError, match=r"only 2 CPU core\(s\).*Sizes that work here: 1, 2"):
        make_llm(tiny_model_dir("qwen3"), tensor_parallel_size=4)


def test_bad_sizes_are_refused_by_the_config():
    from ember.config import EngineConfig

    with pytest.raises(ConfigError, match="integer >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_awq_groups_that_do_not_split_are_refused(tiny_model_dir, tmp_path):
    from tests.quant.test_awq import write_awq_pair

    awq_dir, _ = write_awq_pair(tiny_model_dir("qwen3_moe"), str(tmp_path), 32, skip=["mlp.gate"])
    with pytest.raises(ConfigError, match="AWQ groups of 32"):
        tp_llm(awq_dir)


# ---- lifecycle ------------------------------------------------------------------------------------


def test_shutdown_leaves_no_process(tiny_model_dir):
    llm = tp_llm(tiny_model_dir("qwen3"))
    pids = worker_pids(llm)
    assert pids and not any(gone(p) for p in pids)
    llm.engine.shutdown()
    assert all(gone(p) for p in pids)
    assert parallel_state.get_state() is None
    llm.engine.shutdown()  # twice is harmless


def test_killed_worker_makes_rank0_raise_promptly(tiny_model_dir):
    llm = tp_llm(tiny_model_dir("qwen3"))
    pid = worker_pids(llm)[0]
    generate(llm)  # healthy first
    # Mid-run: the worker dies while rank 0 is stepping (possibly inside a collective).
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    threading.Timer(0.3, os.kill, (pid, signal.SIGKILL)).start()
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match="rank 1"):
        for _ in range(50):
            llm.generate([{"prompt_token_ids": p} for p in PROMPTS], long, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert gone(pid) and parallel_state.get_state() is None
    with pytest.raises(DistributedError):  # and it stays refused
        generate(llm)


def test_killed_idle_worker_is_reported_at_the_next_step(tiny_model_dir):
    llm = tp_llm(tiny_model_dir("qwen3"))
    pid = worker_pids(llm)[0]
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(DistributedError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        generate(llm)
    assert time.monotonic() - t0 < 30


def test_vocab_not_divisible_by_tp_pads_the_last_shard(tiny_model_dir, tmp_path):
    """V = 999 over 2 ranks: rows 0..499 and 500..998 + one zero row; the padded logit is dropped."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    dest = str(tmp_path / "v999")
    shutil.copytree(tiny_model_dir("qwen3"), dest)
    w = load_file(os.path.join(dest, "model.safetensors"))
    w["model.embed_tokens.weight"] = w["model.embed_tokens.weight"][:999].contiguous()
    save_file(w, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dest, "config.json")) as f:
        cfg = json.load(f)
    cfg["vocab_size"] = 999
    with open(os.path.join(dest, "config.json"), "w") as f:
        json.dump(cfg, f)
    prompts = [[t % 999 for t in p] for p in PROMPTS]
    run = lambda llm: llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)  # noqa: E731
    ref = [o.outputs[0] for o in run(make_llm(dest, **HARD))]
    llm = tp_llm(dest, **HARD)
    try:
        assert llm.engine.parts.loaded.model.model.embed_tokens.weight.shape[0] == 500
        assert_same([o.outputs[0] for o in run(llm)], ref)
    finally:
        llm.engine.shutdown()


def test_packed_gguf_is_refused_and_auto_dequantizes(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="--quantization gguf .* dequantized"):
        tp_config.tp_quantization("gguf", str(f))
    assert tp_config.tp_quantization("auto", str(f)) == "none"
    assert tp_config.tp_quantization("auto", str(tmp_path)) == "auto"  # a folder: as stored (dense / AWQ)


def test_hybrid_gated_deltanet_shards_by_key_head_group(tmp_path):
    """Qwen3-Next with two key-head groups (each rank one, with its two value heads and their state),
    gated attention over 4 heads, MoE with a shared expert: TP=2 gives TP=1's tokens, chunked and
    batched, and with prefix-cache hits that restore each rank's state snapshot."""
    from tests.models.tiny_hybrids import VOCAB, build_hybrid, save_hybrid

    path = save_hybrid(
        build_hybrid("qwen3_next", num_attention_heads=4, num_key_value_heads=2, head_dim=12),
        str(tmp_path / "qwen3-next"),
    )
    prompts = [[t % VOCAB for t in p] for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)

    def gen(llm, ps=prompts):
        return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)]

    ref = gen(make_llm(path, **HARD))
    tp = tp_llm(path, max_num_batched_tokens=7, max_num_seqs=6)
    assert_same(gen(tp), ref)
    again = tp.generate([{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)[0]
    # 23 tokens: the hit ends at the end of the prompt less one
    assert again.num_cached_tokens == 22 and again.outputs[0].token_ids == ref[1].token_ids
    tp.engine.shutdown()


def test_qwen4_exp_over_two_ranks_equals_tp1(tmp_path):
    """qwen4_exp (each hyper-connection mixer's down-projection split by input, the PLE table by columns with
    its projections' inputs; the rest of the mixers and the indexer replicated on each rank; attention and
    Gated DeltaNet split as Qwen3.5's): a 120-token prompt (QSA sparse past 67 tokens, an EOS inside) beside
    a short one, 7-token chunks."""
    from tests.models.tiny_qwen4 import build_qwen4, prompt, save_qwen4

    path = save_qwen4(build_qwen4(), str(tmp_path / "qwen4"))
    prompts = [{"prompt_token_ids": p} for p in (prompt(110, 1, eos_at=(30,)), prompt(20, 2))]
    ref = [o.outputs[0] for o in make_llm(path, **HARD).generate(prompts, GREEDY, use_tqdm=False)]
    llm = tp_llm(path, **HARD)
    try:
        assert_same([o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)], ref)
        layers = llm.engine.parts.loaded.model.model.layers
        mixer = layers[0].attn_hyper_connection
        assert mixer.input_mix_weight_down.weight.shape[1] == mixer.hidden * mixer.count // 2  # this rank's half
        ple = next(layer.ple for layer in layers if layer.ple is not None)
        assert ple.table.columns == slice(0, ple.table.dim // 2)  # rank 0 reads the first half of every row
        assert ple.key_proj.weight.shape[1] == ple.cfg.embed_dim // 2
    finally:
        llm.engine.shutdown()
