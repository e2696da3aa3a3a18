"""Which recurrent-state snapshots a hybrid's prefix cache takes and keeps (ember.engine.state_slots),
at the CPU defaults' scale (blocks of 16, 16 sequences, 32 snapshot slots), driven through the real
scheduler and block pool with made-up tokens: plain Python, no model. A request's answer is random
tokens; a hit is counted in prompt tokens served from the cache (Request.num_cached_tokens)."""

from __future__ import annotations

import random

import pytest

from ember.engine.kv_cache import KVCacheManager
from ember.engine.scheduler import Scheduler
from ember.engine.state_slots import StateSlots
from ember.request import Request, RequestStatus

ANSWER = 16


class Server:
    def __init__(self, num_snapshots: int = 32, num_seqs: int = 16, num_blocks: int = 8000, seed: int = 0):
        self.states = StateSlots(num_seqs, num_snapshots, block_size=16)
        self.kv = KVCacheManager(num_blocks, 16, True, self.states)
        self.scheduler = Scheduler(self.kv, 2048, num_seqs, 16384)
        self.rng = random.Random(seed)
        self.count = 0

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1000) for _ in range(n)]

    def submit(self, tokens: list[int]) -> Request:
        self.count += 1
        req = Request(str(self.count), tokens, None)
        self.scheduler.add_request(req)
        return req

    def drain(self) -> None:
        """Steps until every request has its answer: the model's part is a random next token."""
        s = self.scheduler
        while s.num_unfinished:
            out = s.schedule()
            s.update_after_step(out)
            for req, _ in out.scheduled:
                if req.num_computed_tokens == req.num_tokens:
                    req.append_token(self.rng.randrange(1000))
                    if req.num_output_tokens == ANSWER:
                        s.finish_request(req, RequestStatus.FINISHED_LENGTH)

    def hit(self, tokens: list[int]) -> int:
        req = self.submit(tokens)
        self.drain()
        return req.num_cached_tokens

    def all_returned(self) -> bool:
        st = self.states
        return st.num_free == st.num_live and len(st.free_snap) + len(st.named) == st.num_snapshots


@pytest.mark.parametrize("burst", [32, 64])
def test_a_4k_conversation_resumes_after_its_answer_behind_a_burst_of_new_prompts(burst):
    server = Server()
    first = server.submit(server.tokens(4096))
    server.drain()
    for _ in range(burst):
        server.submit(server.tokens(server.rng.randint(500, 1500)))
    server.drain()
    # the first turn computed its prompt and all but the last answer token
    assert server.hit(first.token_ids + server.tokens(50)) == 4096 + ANSWER - 1
    assert server.all_returned()


def test_the_same_prompt_again_runs_its_last_token_only_and_a_longer_one_resumes_at_its_end():
    server = Server()
    prompt = server.tokens(1000)
    assert server.hit(prompt) == 0
    assert server.hit(prompt) == 999
    assert server.hit(prompt + server.tokens(30)) == 999
    assert server.hit(prompt[:700] + server.tokens(30)) == 512  # an interval snapshot (every 256 tokens)
    assert server.all_returned()


def test_a_running_request_keeps_its_partial_block_and_a_hit_ends_at_a_full_one():
    """A partial block is shared only once free (its new owner writes into it): while the first
    request runs, the same prompt resumes at the deepest block-boundary snapshot."""
    server = Server()
    prompt = server.tokens(600)
    first = server.submit(prompt)
    while first.num_computed_tokens < 600:
        server.scheduler.update_after_step(server.scheduler.schedule())
    assert server.hit(prompt) == 512
    server.drain()
    assert server.hit(prompt) == 599
    assert server.all_returned()


def test_snapshots_never_outnumber_their_slots_and_the_deepest_of_a_chain_stays():
    server = Server(num_snapshots=4)
    prompt = server.tokens(2000)
    server.hit(prompt)
    named = sorted(s.tokens for s in server.states.named.values())
    assert len(named) == 4 and named[-1] == 2000 + ANSWER - 1
    assert server.all_returned()


@pytest.mark.parametrize("snapshots, kept", [(16, False), (32, True)])
def test_the_default_two_snapshot_slots_a_sequence_keep_a_conversation_through_a_burst(snapshots, kept):
    """Why --max-state-snapshots defaults to 2 x max_num_seqs: the requests in flight hold one head each,
    so with max_num_seqs slots a burst evicts heads for heads and the clock passes a 4K conversation's
    credit; with twice that the conversation's end survives 32 prompts."""
    server = Server(num_snapshots=snapshots)
    first = server.submit(server.tokens(4096))
    server.drain()
    for _ in range(32):
        server.submit(server.tokens(server.rng.randint(500, 1500)))
    server.drain()
    assert (server.hit(first.token_ids + server.tokens(50)) == 4096 + ANSWER - 1) is kept
