"""Block pool and prefix cache, plain Python (no torch, no model)."""

from ember.engine.kv_cache import KVCacheManager
from ember.request import Request


def req(rid, tokens):
    return Request(rid, tokens, sampling_params=None)


def test_allocate_and_free_restores_pool():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(r.block_ids) == 3 and kv.num_free_blocks == 7
    r.num_computed_tokens = 10
    assert kv.allocate_slots(r, 2)  # 12 tokens still fit 3 blocks
    assert len(r.block_ids) == 3
    assert kv.allocate_slots(r, 3)  # 13 tokens need a 4th
    assert len(r.block_ids) == 4
    kv.free(r)
    assert kv.num_free_blocks == 10 and r.block_ids == []


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = req("a", list(range(12)))
    assert not kv.allocate_slots(r, 12)
    assert kv.num_free_blocks == 2 and r.block_ids == []


def test_prefix_hit_reuses_full_blocks_and_never_the_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    kv.cache_full_blocks(a)
    assert len(a.block_hashes) == 2  # 2 full blocks, the third holds 2 tokens

    b = req("b", list(range(8)) + [99, 98, 97])
    hit = kv.find_cached_prefix(b)
    assert hit.blocks == a.block_ids[:2] and hit.num_tokens == 8
    assert kv.allocate_slots(b, b.num_tokens - 8, hit)
    assert b.block_ids[:2] == a.block_ids[:2]
    assert kv.ref_counts[a.block_ids[0]] == 2

    # A prompt exactly equal to a cached prefix still recomputes its last block.
    c = req("c", list(range(8)))
    assert kv.find_cached_prefix(c).num_tokens == 4


def test_freed_blocks_stay_cached_until_reused_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    blocks = list(a.block_ids)
    kv.free(a)
    assert kv.num_free_blocks == 4
    # Same prefix again: the freed blocks are revived from the free queue.
    b = req("b", [1, 2, 3, 4, 6])
    hit = kv.find_cached_prefix(b)
    assert hit.blocks == blocks[:2]
    assert kv.allocate_slots(b, 1, hit)
    assert kv.num_free_blocks == 1
    assert kv.stats.hits == 4 + 4 - 4  # only b's lookup counted hits (a's lookup was not made)
    kv.free(b)
    # Fill the pool with other tokens: the cached blocks are evicted and their hashes dropped.
    c = req("c", [9] * 8)
    assert kv.allocate_slots(c, 8)
    assert kv.find_cached_prefix(req("d", [1, 2, 3, 4, 5])).blocks == []


def test_revived_cached_blocks_count_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = req("a", [1, 2, 3, 4])
    assert kv.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    kv.cache_full_blocks(a)
    kv.free(a)  # 3 free, 2 of them cached
    b = req("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    hit = kv.find_cached_prefix(b)
    assert len(hit.blocks) == 2
    # needs 5 blocks in all: 2 revived + 3 new > 3 free
    assert not kv.allocate_slots(b, 5, hit)
    assert kv.num_free_blocks == 3 and b.block_ids == []
