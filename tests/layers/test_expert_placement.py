"""The pieces of expert placement that need no model: the hot-expert cache's LRU and its hit / miss counts
(ember.layers.hot_experts), which layers a PlacementConfig puts in host memory and what it refuses
(ember.layers.expert_placement, ember.config.groups.PlacementConfig)."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F

from ember.config import EngineConfig
from ember.config.model_config import ModelConfig
from ember.errors import ConfigError
from ember.layers.expert_placement import layer_index, moe_layers, resolve_placement
from ember.layers.hot_experts import HotExpertCache

H, I = 8, 4


def fill_of(layer: int):
    """Expert e of `layer` as (gate;up, down) whose values name it (so a slot's content can be checked)."""

    def fill(e: int):
        v = 100 * layer + e
        return torch.full((2 * I, H), float(v)), torch.full((H, I), float(v))

    return fill


def cache_of(slots: int) -> HotExpertCache:
    cache = HotExpertCache(H, I, torch.float32, "cpu", fused_act=False)
    assert cache.resize(slots * cache.expert_bytes + cache.expert_bytes // 2) == slots  # whole slots only
    return cache


def step(cache: HotExpertCache, layer: int, chosen: list[int]) -> set[int]:
    """One step of one host layer, as HostExperts.run does it: look up, then admit the misses."""
    hits = cache.lookup(layer, chosen)
    cache.admit(layer, [e for e in chosen if e not in hits], fill_of(layer))
    return set(hits)


def test_lru_evicts_the_least_recently_used_and_counts_each_lookup_once():
    cache = cache_of(2)
    assert step(cache, 0, [1, 2]) == set()  # two misses, both admitted
    assert step(cache, 0, [1, 3]) == {1}  # 1 hit (now most recent); 3 evicts 2, the least recently used
    assert set(cache.slots) == {(0, 1), (0, 3)}
    assert step(cache, 0, [2]) == set()  # 2 was evicted: a miss; it evicts 1
    assert step(cache, 1, [1]) == set()  # another layer's expert 1 is another key
    assert (cache.hits, cache.misses, cache.fills, cache.evictions) == (1, 5, 5, 3)
    assert cache.hit_rate == pytest.approx(1 / 6)
    for (layer, e), slot in cache.slots.items():  # each slot holds what its fill gave
        assert torch.all(cache.w13[slot] == 100 * layer + e) and torch.all(cache.w2[slot] == 100 * layer + e)


def test_more_misses_than_slots_keep_the_last_ones():
    cache = cache_of(2)
    step(cache, 0, [4, 5, 6])
    assert set(cache.slots) == {(0, 5), (0, 6)} and cache.evictions == 0


def test_counts_match_an_lru_simulation_over_a_skewed_routing():
    """A Zipf-like routing of 16 experts through a 5-slot cache: hits and misses as a plain LRU predicts."""
    g = torch.Generator().manual_seed(0)
    probs = 1 / torch.arange(1, 17).float()
    cache, lru, hits = cache_of(5), OrderedDict(), 0
    for _ in range(200):
        chosen = sorted(set(torch.multinomial(probs, 3, generator=g).tolist()))
        step(cache, 0, chosen)
        hit = [e for e in chosen if e in lru]
        hits += len(hit)
        for e in hit:  # used: most recent first, then the misses come in, each evicting the oldest
            lru.move_to_end(e)
        for e in chosen:
            if e not in hit:
                lru[e] = True
                if len(lru) > 5:
                    lru.popitem(last=False)
    assert cache.hits == hits and cache.misses == cache.fills  # every miss admitted (3 a step, 5 slots)
    assert list(cache.slots) == [(0, e) for e in lru]
    assert 0.2 < cache.hit_rate < 0.9  # skewed routing: the hot experts stay


def test_a_slot_runs_its_expert_as_the_dense_reference():
    cache = cache_of(1)
    g = torch.Generator().manual_seed(1)
    w13, w2 = torch.randn(2 * I, H, generator=g), torch.randn(H, I, generator=g)
    cache.admit(0, [3], lambda e: (w13, w2))
    x = torch.randn(2, H, generator=g)
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    torch.testing.assert_close(cache.expert_forward(cache.slots[(0, 3)], x), F.linear(F.silu(gate) * up, w2))


def moe_config(layers: int = 4, **more) -> ModelConfig:
    raw = dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128, intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2,
    )  # fmt: skip
    return ModelConfig.from_dict(raw | more)


def place(mc: ModelConfig, **flags):
    return resolve_placement(EngineConfig(**flags).placement_config, mc, "cpu", torch.float32, object)


def test_the_first_n_moe_layers_go_to_host_memory():
    mc = moe_config(6)  # decoder_sparse_step 2: layers 1, 3, 5 are MoE
    assert moe_layers(mc) == [1, 3, 5]
    assert place(mc, n_cpu_moe=2).host_layers == {1, 3}
    assert place(mc, n_cpu_moe=9).host_layers == {1, 3, 5}  # more than the model has: all of them
    assert place(mc, cpu_moe=True).host_layers == {1, 3, 5}
    assert place(mc) is None and place(mc, n_cpu_moe=0) is None  # nothing placed apart
    assert place(mc, n_cpu_moe=1, moe_hot_cache_memory=0).hot_cache is None
    assert layer_index("model.layers.12.mlp") == 12 and layer_index("mtp.fc") is None


def test_flags_the_model_has_nothing_for_are_refused():
    dense = moe_config(2, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_experts=0)
    with pytest.raises(ConfigError, match="no MoE layers"):
        place(dense, n_cpu_moe=2)
    with pytest.raises(ConfigError, match="--cpu-moe keeps MoE experts in host memory"):
        place(dense, cpu_moe=True)
    with pytest.raises(ConfigError, match="n-gram table"):
        place(moe_config(), ple_offload=True)


@pytest.mark.parametrize(
    "flags,match",
    [
        ({"n_cpu_moe": -1}, "--n-cpu-moe takes a number of MoE layers >= 0"),
        ({"cpu_moe": True, "n_cpu_moe": 2}, "give one of them"),
        ({"moe_hot_cache_memory": 1.0}, "pass --cpu-moe or --n-cpu-moe N"),
        ({"n_cpu_moe": 1, "moe_hot_cache_memory": -1.0}, ">= 0 GiB"),
        ({"n_cpu_moe": 1, "tensor_parallel_size": 2}, "--tensor-parallel-size"),
    ],
)
def test_bad_combinations_are_refused_before_anything_loads(flags, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**flags)


def test_llama_cpp_spellings(caplog):
    import argparse

    from ember.config.engine_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["-ncmoe", "3"])).placement_config.n_cpu_moe == 3
    assert engine_config_from_args(parser.parse_args(["-cmoe"])).placement_config.cpu_moe
    config = engine_config_from_args(parser.parse_args(["--n-cpu-moe", "2", "--moe-hot-cache-memory", "0.5"]))
    assert (config.placement_config.n_cpu_moe, config.placement_config.moe_hot_cache_memory) == (2, 0.5)
