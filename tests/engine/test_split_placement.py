"""Experts in host memory beside the device (--cpu-moe / --n-cpu-moe, ember.layers.expert_placement), tested with
the CPU as the "device": a split placement (the first MoE layer's experts mapped from the file and run on the
host, a hot-expert cache so small that it must evict) gives the same greedy tokens as the all-resident engine,
on a tiny Qwen3-MoE GGUF (experts Q8_0 / Q4_K / Q6_K; tests/models/test_qwen4_split_placement.py does the
same for a tiny qwen4_exp). The cache's hit and miss counts are those of an LRU replayed over the experts each
step chose, and /metrics reports them."""

from __future__ import annotations

import logging
from collections import OrderedDict

import pytest

from ember import LLM, SamplingParams
from ember.errors import ConfigError
from ember.layers.expert_placement import HostExperts
from ember.server.metrics import ServerMetrics
from tests.models.tiny_models import one_thread  # noqa: F401 (fixture)
from tests.models.tiny_moe_gguf import prompt, tiny_moe_gguf

pytestmark = [pytest.mark.engine, pytest.mark.usefixtures("one_thread")]

ENGINE = dict(dtype="float32", executor="eager", max_model_len=256, kv_cache_memory=0.02, max_num_seqs=2, num_threads=1)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def slots_for(llm: LLM, n: int) -> float:
    """--moe-hot-cache-memory (GiB) that holds n experts' copies of this model."""
    cache = llm.engine.parts.loaded.placement.hot_cache
    return (n + 0.5) * cache.expert_bytes / 2**30


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory):
    return tiny_moe_gguf(str(tmp_path_factory.mktemp("split") / "moe.gguf"))


@pytest.fixture(scope="module")
def resident(moe_file):
    prompts = [prompt(40, 1), prompt(23, 2)]
    with LLM(moe_file, **ENGINE) as llm:
        return prompts, greedy(llm, prompts)


def record_choices(llm: LLM) -> list[list[int]]:
    """The distinct experts each step's call of the host layer chose (wrapping HostExperts.run)."""
    experts = next(m for m in llm.engine.parts.loaded.model.modules() if isinstance(m, HostExperts))
    seen, run = [], experts.run

    def recording(x, ids, w):
        seen.append(sorted(set(ids.flatten().tolist())))
        return run(x, ids, w)

    experts.run = recording
    return seen


def lru_hits(steps: list[list[int]], slots: int) -> int:
    lru, hits = OrderedDict(), 0
    for chosen in steps:
        hit = [e for e in chosen if e in lru]
        hits += len(hit)
        for e in hit:
            lru.move_to_end(e)
        for e in [e for e in chosen if e not in hit][-slots:]:
            lru[e] = True
            if len(lru) > slots:
                lru.popitem(last=False)
    return hits


def test_a_split_placement_with_an_evicting_cache_gives_the_resident_tokens(moe_file, resident, caplog):
    prompts, want = resident
    with caplog.at_level(logging.INFO, logger="ember"):
        llm = LLM(moe_file, n_cpu_moe=1, moe_hot_cache_memory=0.001, **ENGINE)
    loaded = llm.engine.parts.loaded
    assert loaded.placement.host_layers == {0} and loaded.mapped_expert_bytes > 0
    assert "routed experts of 1 MoE layer mapped cold from the file" in caplog.text
    cache = loaded.placement.hot_cache
    cache.resize(slots_for(llm, 3) * 2**30)  # 3 of the layer's 8 experts: it must evict
    steps = record_choices(llm)
    assert greedy(llm, prompts) == want
    assert cache.evictions > 0 and cache.hits > 0
    assert cache.hits + cache.misses == sum(len(s) for s in steps)
    assert cache.hits == lru_hits(steps, 3)
    metrics = ServerMetrics("tiny")
    metrics.watch_experts(llm.engine)
    text = metrics.render().decode()
    assert f'ember:moe_hot_cache_hits{{model_name="tiny"}} {float(cache.hits)}' in text
    assert f'ember:moe_hot_cache_hit_rate{{model_name="tiny"}} {cache.hit_rate}' in text
    llm.close()


def test_every_layer_in_host_memory_without_a_cache(moe_file, resident):
    prompts, want = resident
    with LLM(moe_file, cpu_moe=True, **ENGINE) as llm:
        assert greedy(llm, prompts) == want
        loaded = llm.engine.parts.loaded
        assert loaded.placement.hot_cache.capacity == 0  # on CPU the default is none: host memory is the device's
        assert loaded.placement.host_layers == {0, 1}


def test_placing_what_the_model_does_not_have_is_refused(moe_file):
    with pytest.raises(ConfigError, match="does not have"):
        LLM(moe_file, ple_offload=True, **ENGINE)
