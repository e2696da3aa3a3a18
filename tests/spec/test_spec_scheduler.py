"""Scheduling drafts (plain Python): 1 + d tokens under the one budget, drafts give way first,
rejected tokens are not computed and never reach the prefix cache."""

from ember.engine.kv_cache import KVCacheManager, hash_block
from ember.engine.scheduler import Scheduler
from ember.request import Request
from ember.spec.proposer import Draft


def make(num_blocks=64, budget=64, block_size=4):
    return Scheduler(KVCacheManager(num_blocks, block_size), budget, 8, max_model_len=1024)


def decoding(s, *prompts):
    """Requests past their prefill, each with one sampled token: the next step decodes them."""
    reqs = [Request(f"r{i}", list(p), None) for i, p in enumerate(prompts)]
    for r in reqs:
        s.add_request(r)
    out = s.schedule()
    assert len(out.scheduled) == len(reqs)
    s.update_after_step(out)
    for r in reqs:
        r.append_token(7)
    return reqs


def sched(s):
    out = s.schedule()
    return [(r.request_id, n) for r, n in out.scheduled], {k: d.token_ids for k, d in out.drafts.items()}, out


def test_a_draft_asks_for_one_plus_d_tokens_and_slots():
    s = make()
    (a,) = decoding(s, range(6))
    a.draft = Draft([1, 2, 3])
    got, drafts, _ = sched(s)
    assert got == [("r0", 4)] and drafts == {"r0": [1, 2, 3]}
    assert a.draft is None  # consumed
    assert len(a.block_ids) == 3  # 6 + 1 + 3 = 10 slots of 4


def test_drafts_shrink_before_anyone_starves():
    s = make()
    a, b, c = decoding(s, range(2), range(10, 12), range(20, 22))
    s.max_num_batched_tokens = 6
    for r in (a, b, c):
        r.draft = Draft([1, 2, 3])
    got, drafts, _ = sched(s)
    # a keeps 6 - 1 - 2 (one token for each of b and c) = 3 ... of which 3 fit; b and c get their decode only
    assert got == [("r0", 4), ("r1", 1), ("r2", 1)] and drafts == {"r0": [1, 2, 3]}
    s2 = make()
    for r in decoding(s2, range(2), range(10, 12), range(20, 22)):
        r.draft = Draft([1, 2])
    s2.max_num_batched_tokens = 3
    got, drafts, _ = sched(s2)
    assert got == [("r0", 1), ("r1", 1), ("r2", 1)] and drafts == {}


def test_decode_and_drafts_go_before_a_new_prefill():
    s = make()
    (a,) = decoding(s, range(6))
    s.max_num_batched_tokens = 10
    a.draft = Draft([1, 2, 3])
    s.add_request(Request("new", list(range(30, 50)), None))
    got, drafts, _ = sched(s)
    assert got == [("r0", 4), ("new", 6)] and drafts == {"r0": [1, 2, 3]}


def test_drafts_are_dropped_when_their_slots_do_not_fit_and_nobody_is_preempted():
    s = make(num_blocks=3)
    (a,) = decoding(s, range(7))  # 8 tokens in 2 blocks, 1 block free
    a.draft = Draft(list(range(8)))  # 7 + 1 + 8 = 16 slots = 4 blocks: no room
    got, drafts, out = sched(s)
    assert got == [("r0", 1)] and drafts == {} and not out.preempted and s.num_preemptions == 0


def test_rejected_tokens_are_not_computed_and_not_cached():
    s = make()
    (a,) = decoding(s, range(100, 107))  # 7 prompt tokens + 1 sampled, blocks of 4
    a.draft = Draft([1, 2, 3, 4])
    _, _, out = sched(s)
    s.update_after_step(out, {"r0": 2})  # 2 of 4 drafts accepted
    assert a.num_computed_tokens == 7 + 5 - 2
    # token_ids hold 8 tokens until the engine appends the accepted ones: only 2 blocks are named
    assert len(a.block_hashes) == 2
    for t in (1, 2, 9):  # accepted drafts, then the recovered token
        a.append_token(t)
    a.draft = Draft([5])
    _, _, out = sched(s)
    s.update_after_step(out, {"r0": 0})  # positions 10, 11 computed, but 11 (the draft) is not appended yet
    assert a.num_computed_tokens == 12 and len(a.block_hashes) == 2
    a.append_token(5)
    a.append_token(8)
    _, _, out = sched(s)
    s.update_after_step(out)  # the next step names block 2: all real tokens
    assert len(a.block_hashes) == 3
    real = a.token_ids[:12]
    h = None
    for i in range(3):
        h = hash_block(h, tuple(real[4 * i : 4 * i + 4]))
    assert a.block_hashes[2] == h and s.kv.hash_to_block[h] == a.block_ids[2]


def test_preemption_and_finish_drop_pending_drafts():
    s = make(num_blocks=4, budget=64)
    a, b = decoding(s, range(8), range(10, 18))  # 2 full blocks each, the pool is full
    a.draft, b.draft = Draft([1]), Draft([2])
    _, _, out = sched(s)  # a's decode needs a 3rd block: b (newest) is preempted
    assert out.preempted == [b] and b.draft is None
    s.finish_request(a, a.status.FINISHED_ABORTED)
    assert a.draft is None and s.kv.num_free_blocks == 4
