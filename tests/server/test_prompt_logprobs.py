"""Prompt logprobs: vLLM's prompt_logprobs and completions' echo + logprobs (what lm-eval-harness scores
with), equal to transformers' log-softmax on the default model (fp32), across chunked prefill and on a
prompt the prefix cache already holds."""

from __future__ import annotations

import math

import pytest
import torch

from ember.default_model import default_model_path
from tests.server.live import MODEL_NAME, start_server

PROMPT = "The quick brown fox jumps over the lazy dog because it wanted to see the other side of the hill."


@pytest.fixture(scope="module")
def live():
    server = start_server(
        default_model_path(),
        dtype="float32",
        quantization="none",
        num_threads=2,
        kv_cache_memory=0.1,
        max_model_len=512,
        max_num_batched_tokens=16,
        enable_mtp=False,
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(live, default_hf_model):  # tests/conftest.py: transformers' copy, loaded once a session
    hf = default_hf_model
    ids = live.engine.parts.loaded.tokenizer.encode(PROMPT)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    return ids, [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def test_echo_with_logprobs_scores_the_prompt(live, reference):
    ids, ref = reference
    client = live.client()
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache: recomputed, same figures
        r = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2
        )
        lp = r.choices[0].logprobs
        assert r.choices[0].text.startswith(PROMPT)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
        got = lp.token_logprobs[1 : len(ids)]
        assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-3
        assert all(2 <= len(t) <= 3 for t in lp.top_logprobs[1:])
        assert lp.text_offset == sorted(lp.text_offset)


def test_prompt_logprobs_field(live, reference):
    ids, ref = reference
    r = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    pl = r.choices[0].model_extra["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    for i in range(1, len(ids)):
        entry = pl[i][str(ids[i])]
        assert math.isclose(entry["logprob"], ref[i - 1], abs_tol=1e-3) and entry["rank"] >= 1
    chat = live.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=1, extra_body={"prompt_logprobs": 3}
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def test_streamed_echo_with_logprobs(live, reference):
    ids, ref = reference
    stream = live.client().completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
    )
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0]
    assert first.text == PROMPT and first.logprobs.token_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(first.logprobs.token_logprobs[1:], ref)) < 1e-3
