"""The one-budget scheduler, plain Python (no torch, no model)."""

import logging

from ember.engine.kv_cache import KVCacheManager
from ember.engine.scheduler import Scheduler
from ember.request import Request, RequestStatus


def make(num_blocks=64, block_size=4, budget=16, max_seqs=8, chunked=True, prefix=True):
    kv = KVCacheManager(num_blocks, block_size, prefix)
    return Scheduler(kv, budget, max_seqs, max_model_len=1024, enable_chunked_prefill=chunked)


def run_step(s, sample=True):
    """Schedule, then pretend the model ran: advance and append a token where a step reached the end."""
    out = s.schedule()
    ends = {r.request_id for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    s.update_after_step(out)
    for r, _ in out.scheduled:
        if sample and r.request_id in ends:
            r.append_token(7)
    return out


def test_decodes_first_then_prefill_chunks_share_the_budget():
    s = make(budget=10)
    a = Request("a", list(range(6)), None)
    s.add_request(a)
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6)]
    b = Request("b", list(range(100, 120)), None)
    s.add_request(b)
    out = run_step(s)
    # a decodes 1 token; b gets the remaining 9 as its first chunk
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 2)]
    assert b.num_output_tokens == 1  # only the chunk that reached the end sampled
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 1)]


def test_chunked_prefill_off_waits_for_a_whole_budget():
    s = make(budget=10, chunked=False)
    a = Request("a", list(range(6)), None)
    b = Request("b", list(range(100, 109)), None)
    s.add_request(a)
    s.add_request(b)
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 6)]  # b (9) does not fit the 4 left
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_running():
    s = make(budget=100, max_seqs=2)
    for i in range(3):
        s.add_request(Request(str(i), [1, 2, 3], None))
    out = run_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["0", "1"]
    assert len(s.waiting) == 1


def test_preemption_by_recompute_and_resume():
    # 6 blocks of 4 tokens: two requests of 10 tokens take 3 blocks each; growth forces preemption.
    s = make(num_blocks=6, block_size=4, budget=64, prefix=False)
    a = Request("a", list(range(11)), None)
    b = Request("b", list(range(50, 61)), None)
    s.add_request(a)
    s.add_request(b)
    run_step(s)  # both prefilled (11 tokens, 3 blocks each) and sampled a 12th token
    run_step(s)  # token 12 still fits 3 blocks; pool full
    assert s.kv.num_free_blocks == 0
    out = run_step(s)  # both need a 4th block for token 13: b (newest) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_ids == []
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1)]
    assert s.waiting[0] is b
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    out = run_step(s)
    # b comes back and recomputes prompt + its two generated tokens
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 13)]
    assert s.kv.num_free_blocks == 6 - 4


def test_prefix_hit_schedules_only_new_tokens():
    s = make(block_size=4, budget=64)
    a = Request("a", list(range(20)), None)
    s.add_request(a)
    run_step(s)
    s.finish_request(a, RequestStatus.FINISHED_STOPPED)
    b = Request("b", list(range(16)) + [500, 501, 502], None)
    s.add_request(b)
    out = run_step(s)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("b", 3)]
    assert b.num_cached_tokens == 16


def test_abort_frees_everything():
    s = make(budget=8)
    reqs = [Request(str(i), list(range(10 * i, 10 * i + 9)), None) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    run_step(s)
    run_step(s)
    for r in reqs:
        assert s.abort_request(r.request_id)
        assert r.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == s.kv.num_blocks
    assert s.num_unfinished == 0
    assert not s.abort_request("nope")


def test_debug_log_line_per_step(caplog):
    s = make(budget=5)
    s.add_request(Request("a", list(range(12)), None))
    with caplog.at_level(logging.DEBUG, logger="ember.engine.scheduler"):
        run_step(s)
    assert any("tokens scheduled" in m and "prefill chunks [5]" in m and "KV" in m for m in caplog.messages)
