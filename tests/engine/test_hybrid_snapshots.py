"""Prefix-cache snapshots of a hybrid model's recurrent state (ember.engine.state_slots) through the
engine: where they are taken (the end of a prompt and of an answer, inside a block too) and which
ones a burst of other requests leaves. Hits are counted in prompt tokens served from the cache
(RequestOutput.num_cached_tokens), and the tokens of every hit equal the run without a cache."""

from __future__ import annotations

import pytest

from ember.config.model_config import ModelConfig
from tests.engine.test_hybrid_engine import GREEDY, assert_all_returned, make_llm, prompt, run
from tests.models.tiny_models import one_thread  # noqa: F401

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.engine]


@pytest.fixture(scope="module")
def qwen3_5(tiny_hybrid_dir):
    return tiny_hybrid_dir("qwen3_5")


def generate(llm, tokens):
    return llm.generate([{"prompt_token_ids": tokens}], GREEDY, use_tqdm=False)[0]


def test_a_prompt_shorter_than_one_block_hits_and_so_does_its_next_turn(qwen3_5):
    """Blocks of 16 tokens, a prompt of 10: the same prompt again runs only its last token, and the
    next turn resumes after the answer (10 + 19 computed tokens, inside the second block)."""
    llm = make_llm(qwen3_5, block_size=16)
    ref = make_llm(qwen3_5, block_size=16, enable_prefix_caching=False, max_num_seqs=1)
    a = prompt(10, 3)
    first = generate(llm, a)
    assert first.num_cached_tokens == 0
    again = generate(llm, a)
    assert again.num_cached_tokens == 9 and again.outputs[0].token_ids == first.outputs[0].token_ids
    turn2 = a + first.outputs[0].token_ids + prompt(5, 4)
    out = generate(llm, turn2)
    assert out.num_cached_tokens == 10 + 19 and out.outputs[0].token_ids == run(ref, [turn2])[0]
    assert_all_returned(llm)


def test_a_conversation_keeps_its_snapshot_through_a_burst_of_new_prompts(qwen3_5):
    """32 snapshot slots, a 150-token conversation, then 32 new prompts of 20-60 tokens (4 at a time):
    the second turn still resumes after the first answer, where a least-recently-used pool has
    given every slot to the burst."""
    mc = ModelConfig.from_folder(qwen3_5)
    states = mc.state_bytes_per_seq(4) * (4 + 32)
    kv = 1024 * 4 * mc.kv_bytes_per_token_per_dtype_byte * 4  # 1024 blocks: the KV of them all stays cached
    llm = make_llm(qwen3_5, kv_cache_memory=(states + kv) / 2**30, max_state_snapshots=32, max_model_len=256)
    ref = make_llm(qwen3_5, enable_prefix_caching=False, max_num_seqs=1, max_model_len=256)
    a = prompt(150, 11)
    answer = generate(llm, a).outputs[0].token_ids
    burst = [prompt(20 + (37 * i) % 41, 200 + i) for i in range(32)]
    run(llm, burst)
    turn2 = a + answer + prompt(6, 12)
    out = generate(llm, turn2)
    assert out.num_cached_tokens == 150 + 19 and out.outputs[0].token_ids == run(ref, [turn2])[0]
    assert_all_returned(llm)
