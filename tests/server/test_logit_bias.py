"""logit_bias (OpenAI's): applied in the sampler, on both endpoints; an id outside the vocabulary is a 400
naming it and the vocabulary size."""

from __future__ import annotations

import openai
import pytest

from tests.server.live import MODEL_NAME


def test_a_large_bias_forces_a_token_and_a_ban_removes_one(client, server):
    tok = server.engine.parts.loaded.tokenizer
    plain = client.completions.create(model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0)
    first = plain.choices[0].text
    forced_id = 7
    forced = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=1.0, seed=3, logit_bias={str(forced_id): 100}
    )
    assert forced.choices[0].text == tok.decode([forced_id] * 6)
    greedy_ids = tok.encode(first, add_special_tokens=False)
    banned = client.completions.create(
        model=MODEL_NAME, prompt="hello world", max_tokens=6, temperature=0, logit_bias={str(greedy_ids[0]): -100}
    )
    assert greedy_ids[0] not in tok.encode(banned.choices[0].text, add_special_tokens=False)[:1]
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        temperature=0,
        logit_bias={str(forced_id): 100},
    )
    assert chat.choices[0].message.content == tok.decode([forced_id] * 4)


def test_an_id_outside_the_vocabulary_names_it_and_the_size(client, server):
    vocab = server.engine.parts.loaded.model_config.vocab_size
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            logit_bias={str(vocab + 1): 1.0},
        )
    assert str(vocab + 1) in e.value.body["message"] and str(vocab) in e.value.body["message"]
    ok = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, logit_bias={str(vocab - 1): 1.0}
    )
    assert ok.choices[0].message.content is not None


def test_top_logprobs_minus_one_is_the_whole_vocabulary_under_max_logprobs(client, server, tiny_qwen3):
    from tests.server.live import start_server

    with pytest.raises(openai.BadRequestError) as e:  # the default cap, 20
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1, logprobs=True, top_logprobs=-1
        )
    assert "--max-logprobs 20" in e.value.body["message"] and e.value.body["param"] == "top_logprobs"
    vocab = server.engine.parts.loaded.model_config.vocab_size
    wide = start_server(tiny_qwen3, max_logprobs=-1)
    try:
        r = wide.client().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=1, logprobs=True, top_logprobs=-1
        )
        tops = r.choices[0].logprobs.content[0].top_logprobs
        assert len(tops) == vocab
        c = wide.client().completions.create(model=MODEL_NAME, prompt="hi", max_tokens=1, logprobs=-1)
        assert len(c.choices[0].logprobs.top_logprobs[0]) > 20  # keyed by text: the tiny vocabulary repeats texts
    finally:
        wide.stop()
