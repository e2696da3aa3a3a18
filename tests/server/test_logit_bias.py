"""logit_bias (OpenAI's): applied in the sampler, on both endpoints; an id outside the vocabulary is a 400
naming it and the vocabulary size."""
from __future__ import annotations

import openai
import pytest

from tests.server.live import MODEL_NAME


def test_a_large_bias_forces_a_token_and_a_ban_removes_one(client, server):
    tok = server.engine.tokenizer
    plain = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0)
    first = plain.choices[0].text
    forced_id = 7
    forced = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=1.0, seed=3,
                                       logit_bias={str(forced_id): 100})
    assert forced.choices[0].text == tok.decode([forced_id] * 6)
    greedy_ids = tok.encode(first, add_special_tokens=False)
    banned = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0,
                                       logit_bias={str(greedy_ids[0]): -100})
    assert greedy_ids[0] not in tok.encode(banned.choices[0].text, add_special_tokens=False)[:1]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(forced_id): 100})
    assert chat.choices[0].message.content == tok.decode([forced_id] * 4)


def test_an_id_outside_the_vocabulary_names_it_and_the_size(client, server):
    vocab = server.engine.model_config.vocab_size
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       logit_bias={str(vocab + 1): 1.0})
    assert str(vocab + 1) in e.value.body["message"] and str(vocab) in e.value.body["message"]
    ok = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        logit_bias={str(vocab - 1): 1.0})
    assert ok.choices[0].message.content is not None
