"""vLLM's server extensions that load balancers and scripts use: the `vllm:` metric names (counted as vLLM's
own server test counts them), GET /load, the ORCA load header, SageMaker's /invocations and the batch chat
route; plus vLLM's request checks (64-bit seeds, "out of vocabulary"). Live server on the tiny Qwen3."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest

from tests.server.live import MODEL_NAME
from tests.server.test_streaming import metric_samples, slowed, value

MSGS = [{"role": "user", "content": "Write a long story."}]


def test_vllm_metric_names_count_what_vllm_counts(server, client):
    server.wait_idle()
    before = metric_samples(server)
    n, max_tokens = 4, 6
    prompt = [5, 17, 42, 99, 7, 3, 12]
    for _ in range(n):
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
        assert r.usage.completion_tokens == max_tokens
    server.wait_idle()
    after = metric_samples(server)

    def grew(name):
        return value(after, name) - value(before, name)

    p = len(prompt)
    expected = {
        "vllm:time_to_first_token_seconds_count": n,
        "vllm:inter_token_latency_seconds_count": n * (max_tokens - 1),
        "vllm:e2e_request_latency_seconds_count": n,
        "vllm:request_queue_time_seconds_count": n,
        "vllm:request_inference_time_seconds_count": n,
        "vllm:request_prefill_time_seconds_count": n,
        "vllm:request_decode_time_seconds_count": n,
        "vllm:request_prompt_tokens_sum": n * p,
        "vllm:request_generation_tokens_sum": n * max_tokens,
        "vllm:request_params_n_count": n,
        "vllm:request_params_max_tokens_sum": n * max_tokens,
        "vllm:iteration_tokens_total_sum": n * (p + max_tokens),
        "vllm:iteration_tokens_total_count": n * max_tokens,  # one request at a time, no speculation here
        "vllm:prompt_tokens_total": n * p,
        "vllm:generation_tokens_total": n * max_tokens,
    }
    for name, want in expected.items():
        assert grew(name) == want, name
        # the same measurement under ember's name
        assert grew(name.replace("vllm:", "ember:")) == want, name
    assert (
        value(after, "vllm:request_success_total", finished_reason="length")
        - value(before, "vllm:request_success_total", finished_reason="length")
        == n
    )
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    text = httpx.get(server.url + "/metrics").text
    assert 'reason="capacity"' in text and "vllm:num_requests_waiting_by_reason{" in text
    assert "vllm:cache_config_info{" in text and 'block_size="16"' in text


def test_load_counts_generation_requests_in_flight(server, client, monkeypatch):
    server.wait_idle()
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}
    slowed(monkeypatch, server.engine, 0.05)
    started = threading.Event()

    def long_request():
        started.set()
        client.completions.create(model=MODEL_NAME, prompt="a long one", max_tokens=40, extra_body={"ignore_eos": True})

    t = threading.Thread(target=long_request)
    t.start()
    started.wait()
    seen = 0
    for _ in range(100):
        seen = httpx.get(server.url + "/load").json()["server_load"]
        if seen:
            break
        threading.Event().wait(0.02)
    t.join()
    assert seen == 1
    assert httpx.get(server.url + "/load").json() == {"server_load": 0}


@pytest.mark.parametrize("fmt", ["TEXT", "json"])
def test_orca_load_report_header_when_asked(server, fmt):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    r = httpx.post(server.url + "/v1/completions", json=body, headers={"endpoint-load-metrics-format": fmt})
    report = r.headers["endpoint-load-metrics"]
    if fmt == "TEXT":
        assert report.startswith("TEXT ") and "named_metrics.kv_cache_usage_perc=" in report
        assert "named_metrics.num_requests_waiting=" in report
    else:
        assert report.startswith("JSON ")
        named = json.loads(report[5:])["named_metrics"]
        assert 0.0 <= named["kv_cache_usage_perc"] <= 1.0 and named["num_requests_waiting"] >= 0
    plain = httpx.post(server.url + "/v1/completions", json=body)
    assert "endpoint-load-metrics" not in plain.headers
    other = httpx.post(server.url + "/v1/completions", json=body, headers={"endpoint-load-metrics-format": "BIN"})
    assert other.status_code == 200 and "endpoint-load-metrics" not in other.headers


def test_invocations_answers_as_the_route_the_body_names(server, client):
    chat = {"model": MODEL_NAME, "messages": MSGS, "max_completion_tokens": 5, "temperature": 0.0}
    want = client.chat.completions.create(**chat).model_dump()
    got = httpx.post(server.url + "/invocations", json=chat).json()
    assert got.keys() == want.keys() and got["choices"] == want["choices"]
    comp = {"model": MODEL_NAME, "prompt": "once upon", "max_tokens": 4, "temperature": 0.0}
    want = client.completions.create(**comp).model_dump()
    got = httpx.post(server.url + "/invocations", json=comp).json()
    assert got["object"] == "text_completion" and got["choices"][0]["text"] == want["choices"][0]["text"]
    for bad in ({"model": MODEL_NAME}, [1, 2], {"messages": "hi"}):
        r = httpx.post(server.url + "/invocations", json=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], bad


def test_batch_chat_answers_each_conversation(server, client):
    convs = [[{"role": "user", "content": "alpha"}], [{"role": "user", "content": "beta beta"}]]
    r = httpx.post(
        server.url + "/v1/chat/completions/batch",
        json={"model": MODEL_NAME, "messages": convs, "max_tokens": 5, "temperature": 0.0, "n": 2},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    singles = [
        client.chat.completions.create(model=MODEL_NAME, messages=c, max_tokens=5, temperature=0.0) for c in convs
    ]
    assert body["choices"][0]["message"]["content"] == singles[0].choices[0].message.content
    assert body["choices"][2]["message"]["content"] == singles[1].choices[0].message.content
    assert body["usage"]["prompt_tokens"] == sum(s.usage.prompt_tokens for s in singles)
    assert body["usage"]["completion_tokens"] == 2 * sum(s.usage.completion_tokens for s in singles)  # n=2, greedy
    # streaming is refused; a bad conversation fails the batch and leaves no request running
    r = httpx.post(server.url + "/v1/chat/completions/batch", json={"messages": convs, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    r = httpx.post(
        server.url + "/v1/chat/completions/batch",
        json={"messages": [convs[0], [{"role": "user", "content": [{"type": "image_url"}]}]]},
    )
    assert r.status_code == 400
    r = httpx.post(server.url + "/v1/chat/completions/batch", json={"messages": [convs[0], []]})
    assert r.status_code == 400
    server.wait_idle()
    assert server.engine.parts.scheduler.running == [] and not server.engine.parents


def test_seed_outside_64_bits_is_a_400_naming_the_bound(client):
    for seed in (-(2**63) - 1, 2**63):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, messages=MSGS, seed=seed, max_tokens=1)
        assert "greater_than_equal" in e.value.message or "less_than_equal" in e.value.message
    r = client.chat.completions.create(model=MODEL_NAME, messages=MSGS, seed=2**63 - 1, max_tokens=1)
    assert r.usage.completion_tokens == 1


def test_prompt_ids_out_of_vocabulary_say_so(client):
    with pytest.raises(openai.BadRequestError, match="out of vocabulary"):
        client.completions.create(model=MODEL_NAME, prompt=[999999], max_tokens=2)


def test_each_listed_token_leads_its_top_logprobs(client):
    """vLLM's order (its own test reads it): the echoed or sampled token first in top_logprobs, then the top n."""
    for temperature in (0.0, 1.0):
        r = client.completions.create(
            model=MODEL_NAME,
            prompt="Say hello, world, again and again",
            echo=True,
            max_tokens=6,
            logprobs=1,
            temperature=temperature,
            seed=3,
            extra_body={"return_tokens_as_token_ids": True},
        )
        lp = r.choices[0].logprobs
        assert lp.top_logprobs[0] is None and len(lp.tokens) == len(lp.top_logprobs)
        assert lp.tokens[1:] == [next(iter(top)) for top in lp.top_logprobs[1:]]
        assert all(1 <= len(top) <= 2 for top in lp.top_logprobs[1:])


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, server):
    long_prompt = " ".join(["word"] * 400)  # longer than the tiny model's max_model_len
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=long_prompt, max_tokens=2)
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=long_prompt,
        max_tokens=2,
        temperature=0,
        echo=True,
        extra_body={"truncate_prompt_tokens": 20, "return_token_ids": True},
    )
    ids = server.engine.parts.loaded.tokenizer.encode(long_prompt)
    assert r.usage.prompt_tokens == 20 and r.choices[0].prompt_token_ids == ids[-20:]
    assert r.choices[0].text.startswith(server.engine.parts.loaded.tokenizer.decode(ids[-20:]))
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": long_prompt}],
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 30},
    )
    assert chat.usage.prompt_tokens == 30
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={"truncate_prompt_tokens": 0})


@pytest.mark.parametrize(
    "field, value", [("use_beam_search", True), ("allowed_token_ids", [1, 2]), ("bad_words", ["x"]), ("priority", 3)]
)
def test_vllm_fields_ember_does_not_implement_are_refused_by_name(client, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={field: value})
    assert field in e.value.message and e.value.body["param"] == field
    client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, extra_body={field: None})  # unset: fine
