"""stream_options.continuous_usage_stats, --enable-force-include-usage, --enable-prompt-tokens-details and
--enable-request-id-headers."""

from __future__ import annotations

import httpx
import pytest

from tests.server.live import MODEL_NAME, start_server

MSGS = [{"role": "user", "content": "hello"}]


def _check_running_usage(chunks, expected_tokens: int) -> None:
    last = 0
    for chunk in chunks:
        u = chunk.usage
        assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens
        assert last == 0 or u.completion_tokens > last or (not chunk.choices and u.completion_tokens == last)
        last = u.completion_tokens
    assert last == expected_tokens


def test_continuous_usage_stats_on_both_endpoints(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=MSGS,
        max_tokens=10,
        stream=True,
        extra_body={"min_tokens": 10},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    _check_running_usage(list(chat), 10)
    comp = client.completions.create(
        model=MODEL_NAME,
        prompt="hello",
        max_tokens=7,
        stream=True,
        extra_body={"min_tokens": 7},
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    _check_running_usage(list(comp), 7)
    plain = list(
        client.chat.completions.create(
            model=MODEL_NAME, messages=MSGS, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens <= 3


@pytest.fixture(scope="module")
def flagged(tiny_qwen3):
    server = start_server(
        tiny_qwen3,
        server_knobs={
            "enable_force_include_usage": True,
            "enable_request_id_headers": True,
            "enable_prompt_tokens_details": True,
        },
    )
    yield server
    server.stop()


def test_force_include_usage(flagged):
    stream = flagged.client().chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=6, stream=True, extra_body={"min_tokens": 6}
    )
    _check_running_usage(list(stream), 6)


def test_prompt_tokens_details_only_with_the_flag(flagged, client):
    """vLLM's rule: usage.prompt_tokens_details (the prefix-cache hit) under --enable-prompt-tokens-details."""
    kw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "the same prompt twice " * 8}], max_tokens=2)
    for _ in range(2):
        with_flag = flagged.client().chat.completions.create(**kw)
        without = client.chat.completions.create(**kw)
    assert with_flag.usage.prompt_tokens_details.cached_tokens > 0  # the second time it was cached
    assert without.usage.prompt_tokens_details is None
    comp = flagged.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=1)
    assert comp.usage.prompt_tokens_details.cached_tokens >= 0


def test_request_id_headers(flagged, server):
    made = httpx.get(flagged.url + "/health").headers.get("x-request-id", "")
    assert len(made) == 32
    assert httpx.get(flagged.url + "/health", headers={"X-Request-Id": "Custom"}).headers["x-request-id"] == "Custom"
    assert "x-request-id" not in httpx.get(server.url + "/health").headers  # off by default


@pytest.mark.engine
def test_root_path_serves_with_and_without_the_prefix(tiny_qwen3):
    server = start_server(tiny_qwen3, root_path="/llm")
    try:
        for base in ("/v1", "/llm/v1"):
            client = __import__("openai").OpenAI(base_url=server.url + base, api_key="x", max_retries=0)
            r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2)
            assert r.choices[0].message.content is not None
    finally:
        server.stop()


def test_vllm_spellings_of_dtype_are_taken(caplog):
    import torch

    from ember.config import EngineConfig
    from ember.engine.startup.device import resolve_dtype
    from ember.platform import has_cpu_flags, resolve_dtype_name

    assert EngineConfig(dtype="half").dtype == "float16" and EngineConfig(dtype="float").dtype == "float32"
    # float16 on a CPU without float16 arithmetic computes as auto does there (vLLM's CPU backend does too)
    if not has_cpu_flags("avx512_fp16"):
        with caplog.at_level("WARNING", logger="ember"):
            got = resolve_dtype("float16", torch.device("cpu"))
        assert got == getattr(torch, resolve_dtype_name("auto", "cpu")) and "no float16 arithmetic" in caplog.text


@pytest.mark.engine
def test_return_tokens_as_token_ids_server_default(tiny_qwen3):
    server = start_server(tiny_qwen3, server_knobs={"return_tokens_as_token_ids": True})
    try:
        r = server.client().completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=3, logprobs=1, extra_body={"return_token_ids": True}
        )
        assert r.choices[0].logprobs.tokens == [f"token_id:{t}" for t in r.choices[0].token_ids]
        off = server.client().completions.create(
            model=MODEL_NAME, prompt="hi", max_tokens=3, logprobs=1, extra_body={"return_tokens_as_token_ids": False}
        )
        assert not off.choices[0].logprobs.tokens[0].startswith("token_id:")
    finally:
        server.stop()
