"""The async engine under the API: a client that hangs up frees its KV blocks, 32 concurrent
streams all finish with exact usage, and /metrics parses and moves."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.live import MODEL_NAME

pytestmark = pytest.mark.engine  # every test here runs against a live server

MSGS = [{"role": "user", "content": "Write a long story."}]


def metric_samples(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def slowed(monkeypatch, engine, seconds: float = 0.01) -> None:
    real = engine.step

    def step():
        time.sleep(seconds)
        return real()

    monkeypatch.setattr(engine, "step", step)


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, monkeypatch, caplog):
    caplog.set_level("INFO", logger="ember.async_engine")
    server.wait_idle()
    total = server.engine.parts.kv.num_blocks
    before = metric_samples(server)
    slowed(monkeypatch, server.engine)  # 200 tokens now take > 2 s: the hang-up comes first
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=30) as r:
        got = 0
        # held in a name: a generator dropped by `break` is closed at once, and closing httpx's line
        # iterator closes the connection, which would abort the request before the checks below
        lines = r.iter_lines()
        for line in lines:
            if '"content"' in line and '"role"' not in line:
                got += 1
            if got == 3:
                break
        assert server.engine.has_unfinished_requests()
        assert server.engine.parts.kv.num_free_blocks < total  # it holds blocks while running
    # the connection is closed here, mid-stream
    server.wait_idle(timeout=10)
    assert server.engine.parts.kv.num_free_blocks == total
    after = metric_samples(server)
    assert (
        value(after, "ember:request_success_total", finished_reason="abort")
        == value(before, "ember:request_success_total", finished_reason="abort") + 1
    )
    generated = value(after, "ember:generation_tokens_total") - value(before, "ember:generation_tokens_total")
    assert 3 <= generated < 200
    assert "aborted before it finished" in caplog.text  # the operator sees why the request ended


def test_disconnect_while_waiting_for_whole_answer(server, monkeypatch):
    server.wait_idle()
    before = metric_samples(server)
    slowed(monkeypatch, server.engine)
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 200, "ignore_eos": True}
    try:
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=0.5)
    except httpx.TimeoutException:
        pass
    server.wait_idle(timeout=10)
    after = metric_samples(server)
    assert (
        value(after, "ember:request_success_total", finished_reason="abort")
        == value(before, "ember:request_success_total", finished_reason="abort") + 1
    )


def test_32_concurrent_streams_exact_usage(server):
    server.wait_idle()
    tok = server.engine.parts.loaded.tokenizer

    async def one(client, i: int):
        messages = [{"role": "user", "content": f"Request number {i}: " + "go " * (i % 5)}]
        max_tokens = 4 + i % 9
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            max_tokens=max_tokens,
            stream=True,
            temperature=0.7,
            seed=i,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text, usage, finish = "", None, None
        async for ch in stream:
            if ch.usage:
                usage = ch.usage
            for c in ch.choices:
                text += c.delta.content or ""
                finish = c.finish_reason or finish
        prompt = len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        return usage, prompt, max_tokens, finish

    async def run():
        client = server.async_client()
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    before = metric_samples(server)
    results = asyncio.run(run())
    for usage, prompt, max_tokens, finish in results:
        assert finish == "length"
        assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
            prompt,
            max_tokens,
            prompt + max_tokens,
        )
    server.wait_idle()
    after = metric_samples(server)
    done = sum(r[2] for r in results)
    assert value(after, "ember:generation_tokens_total") - value(before, "ember:generation_tokens_total") == done
    assert value(after, "ember:prompt_tokens_total") - value(before, "ember:prompt_tokens_total") == sum(
        r[1] for r in results
    )
    assert (
        value(after, "ember:request_success_total", finished_reason="length")
        - value(before, "ember:request_success_total", finished_reason="length")
        == 32
    )


def test_metrics_parse_and_move(server, client):
    server.wait_idle()
    before = metric_samples(server)
    client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=5, extra_body={"ignore_eos": True})
    client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=5, extra_body={"ignore_eos": True})
    try:
        client.chat.completions.create(model="nope", messages=MSGS)
    except Exception:  # noqa: BLE001 -- a 404 on purpose
        pass
    server.wait_idle()
    after = metric_samples(server)
    ep = "/v1/chat/completions"
    assert (
        value(after, "ember:http_requests_total", endpoint=ep, status="200")
        - value(before, "ember:http_requests_total", endpoint=ep, status="200")
        == 2
    )
    assert (
        value(after, "ember:http_requests_total", endpoint=ep, status="404")
        - value(before, "ember:http_requests_total", endpoint=ep, status="404")
        == 1
    )
    assert value(after, "ember:generation_tokens_total") - value(before, "ember:generation_tokens_total") == 10
    for hist in (
        "ember:time_to_first_token_seconds_count",
        "ember:e2e_request_latency_seconds_count",
        "ember:time_per_output_token_seconds_count",
    ):
        assert value(after, hist) - value(before, hist) == 2, hist
    # the same prompt twice: the second finds it in the prefix cache
    assert value(after, "ember:prefix_cache_hits_total") > value(before, "ember:prefix_cache_hits_total")
    assert value(after, "ember:prefix_cache_queries_total") > value(before, "ember:prefix_cache_queries_total")
    assert value(after, "ember:num_requests_running") == 0 and value(after, "ember:num_requests_waiting") == 0
    assert 0.0 <= value(after, "ember:kv_cache_usage_perc") <= 1.0
    assert 0.0 < value(after, "ember:prefix_cache_hit_rate") <= 1.0


def test_engine_step_failure_fails_its_requests_and_serving_goes_on(server, client, monkeypatch):
    import openai
    import pytest

    server.wait_idle()
    real = server.engine.step
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("kernel exploded")
        return real()

    monkeypatch.setattr(server.engine, "step", flaky)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=20, extra_body={"ignore_eos": True})
    assert "exploded" not in e.value.response.text
    server.wait_idle()
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_health_is_503_until_warmup_is_done(tiny_qwen3, monkeypatch):
    import threading

    from ember.engine.async_engine import AsyncLLMEngine
    from tests.server.live import start_server

    gate = threading.Event()
    real = AsyncLLMEngine.warmup

    def gated(self):
        gate.wait(30)
        return real(self)

    monkeypatch.setattr(AsyncLLMEngine, "warmup", gated)
    live = start_server(tiny_qwen3, warmup=True, wait_ready=False)
    try:
        r = httpx.get(live.url + "/health", timeout=5)
        assert r.status_code == 503 and "warming up" in r.json()["error"]["message"]
        # a request that comes during warmup waits for it, then is served
        result = {}
        t = threading.Thread(
            target=lambda: result.update(
                r=live.client().completions.create(
                    model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"ignore_eos": True}
                )
            )
        )
        t.start()
        time.sleep(0.3)
        assert "r" not in result
        gate.set()
        t.join(30)
        assert result["r"].usage.completion_tokens == 2
        assert httpx.get(live.url + "/health", timeout=5).status_code == 200
        assert live.async_engine.warmup_seconds is not None
    finally:
        gate.set()
        live.stop()


def test_n_sequences_stream_one_choice_per_chunk(client):
    """OpenAI sends each choice in its own chunk; a client that reads choices[0] (vLLM's own test does)
    must see every sequence's text."""
    whole = client.completions.create(model=MODEL_NAME, prompt="hello", n=3, max_tokens=8, temperature=1.0, seed=9)
    stream = client.completions.create(
        model=MODEL_NAME, prompt="hello", n=3, max_tokens=8, temperature=1.0, seed=9, stream=True
    )
    texts = ["", "", ""]
    for chunk in stream:
        if chunk.choices:
            assert len(chunk.choices) == 1
            texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5, stream=True
    )
    assert all(len(c.choices) == 1 for c in chat if c.choices)
