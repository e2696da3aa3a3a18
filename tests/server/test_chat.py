"""/v1/chat/completions through the official openai client: whole and streamed answers agree,
usage is exact, stop strings, seeds, n, logprobs per the current OpenAI spec."""

from __future__ import annotations

import httpx
import pytest

from tests.server.live import MODEL_NAME

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the weather."}]


def prompt_len(server, messages=MSGS) -> int:
    tokenizer = server.engine.parts.loaded.tokenizer
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def stream_text(client, **kw):
    """(text per choice index, finish reasons, usage or None, number of content chunks)."""
    texts, finish, usage, n_chunks = {}, {}, None, 0
    for ch in client.chat.completions.create(stream=True, **kw):
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            if c.delta.content:
                texts[c.index] = texts.get(c.index, "") + c.delta.content
                n_chunks += 1
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    return texts, finish, usage, n_chunks


def test_greedy_whole_and_stream_agree_with_exact_usage(server, client):
    kw = dict(model=MODEL_NAME, messages=MSGS, temperature=0, max_tokens=12, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.model == MODEL_NAME and r.id.startswith("chatcmpl-")
    c = r.choices[0]
    assert c.message.role == "assistant" and c.finish_reason == "length" and c.message.content
    assert r.usage.prompt_tokens == prompt_len(server)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12

    texts, finish, usage, n_chunks = stream_text(client, stream_options={"include_usage": True}, **kw)
    assert texts[0] == c.message.content
    assert finish == {0: "length"}
    assert n_chunks > 1  # really streamed
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        r.usage.prompt_tokens,
        12,
        r.usage.total_tokens,
    )
    # as vLLM, the prefix-cache hit is reported only under --enable-prompt-tokens-details
    assert usage.prompt_tokens_details is None


def test_stream_without_include_usage_has_no_usage(client):
    texts, finish, usage, _ = stream_text(client, model=MODEL_NAME, messages=MSGS, max_tokens=4, temperature=0)
    assert usage is None and finish[0] in ("length", "stop")


def test_raw_sse_format(server):
    body = {
        "model": MODEL_NAME,
        "messages": MSGS,
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert '"role":"assistant"' in events[0]
    assert '"usage":{' in events[-2] and '"choices":[]' in events[-2]


def test_content_parts_and_roles(server, client):
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=2)
    flat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi\nthere"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Again"},
    ]
    assert r.usage.prompt_tokens == prompt_len(server, flat)


def test_stop_string_cuts_output_whole_and_streamed(client):
    base = dict(model=MODEL_NAME, messages=MSGS, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**base).choices[0].message.content
    # a stop string from the middle of the greedy text (not present earlier in it)
    for start in range(3, len(full) - 3):
        stop = full[start : start + 3]
        if full.find(stop) == start and stop.strip() and "\ufffd" not in stop:
            break
    else:
        pytest.skip("no usable stop string in this output")
    r = client.chat.completions.create(stop=[stop, "never-there"], **base)
    assert r.choices[0].message.content == full[:start]
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra.get("stop_reason") == stop
    texts, finish, _, _ = stream_text(client, stop=stop, **base)
    assert texts.get(0, "") == full[:start] and finish[0] == "stop"
    # include_stop_str_in_output keeps it (vLLM's extra)
    r = client.chat.completions.create(
        stop=stop, **{**base, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}}
    )
    assert r.choices[0].message.content == full[:start] + stop


def test_seed_reproducible_and_n2(client):
    kw = dict(
        model=MODEL_NAME, messages=MSGS, temperature=1.0, top_p=0.95, max_tokens=10, extra_body={"ignore_eos": True}
    )
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    c = client.chat.completions.create(seed=4321, **kw).choices[0].message.content
    assert a == b and a != c
    r = client.chat.completions.create(seed=7, n=2, **kw)
    assert [ch.index for ch in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    assert r.usage.completion_tokens == 20
    r2 = client.chat.completions.create(seed=7, n=2, **kw)
    assert [ch.message.content for ch in r2.choices] == [ch.message.content for ch in r.choices]
    texts, finish, usage, _ = stream_text(client, seed=7, n=2, stream_options={"include_usage": True}, **kw)
    assert [texts[0], texts[1]] == [ch.message.content for ch in r.choices]
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 20


def test_greedy_is_temperature_zero_and_penalties_accepted(client):
    kw = dict(model=MODEL_NAME, messages=MSGS, max_tokens=8, extra_body={"ignore_eos": True})
    a = client.chat.completions.create(temperature=0, seed=1, **kw).choices[0].message.content
    b = client.chat.completions.create(temperature=0, seed=2, **kw).choices[0].message.content
    assert a == b
    r = client.chat.completions.create(temperature=0, presence_penalty=1.5, frequency_penalty=1.0, **kw)
    assert r.usage.completion_tokens == 8


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=9, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 3


def test_default_max_tokens_fills_the_context(server, client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.total_tokens == server.engine.parts.limits.max_model_len and r.choices[0].finish_reason == "length"


def test_logprobs_current_spec(client):
    kw = dict(model=MODEL_NAME, messages=MSGS, temperature=0, max_tokens=6, extra_body={"ignore_eos": True})
    r = client.chat.completions.create(logprobs=True, top_logprobs=3, **kw)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    for pos in content:
        assert len(pos.top_logprobs) == 3
        lps = [t.logprob for t in pos.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert pos.token == pos.top_logprobs[0].token and pos.logprob == pytest.approx(lps[0])  # greedy
        assert isinstance(pos.bytes, list) and all(0 <= b < 256 for b in pos.bytes)
    # the bytes of all tokens are the UTF-8 of the text (stop-free, so nothing is cut)
    assert bytes(b for pos in content for b in pos.bytes).decode("utf-8", "replace") == r.choices[0].message.content
    # logprobs=True alone: the sampled token's logprob and an empty top list (vllm#4795)
    r = client.chat.completions.create(logprobs=True, **kw)
    assert all(p.top_logprobs == [] for p in r.choices[0].logprobs.content)
    assert client.chat.completions.create(**kw).choices[0].logprobs is None
    # streamed: one entry per token, same values
    stream = client.chat.completions.create(logprobs=True, top_logprobs=3, stream=True, **kw)
    streamed = [p for ch in stream for c in ch.choices if c.logprobs for p in c.logprobs.content]
    assert [p.token for p in streamed] == [p.token for p in content]
    assert [p.logprob for p in streamed] == pytest.approx([p.logprob for p in content])


def test_models_health_version(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL_NAME, "alias"]
    assert client.models.retrieve("alias").id == "alias"
    r = client.chat.completions.create(model="alias", messages=MSGS, max_tokens=1)
    assert r.model == "alias"
    assert httpx.get(server.url + "/health").status_code == 200
    from ember.server.api import ember_version

    assert httpx.get(server.url + "/version").json() == {"version": ember_version()}
    assert server.async_engine.warmup_seconds is not None  # the main server warms up, as `ember serve` does
