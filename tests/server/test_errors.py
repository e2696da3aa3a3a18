"""Bad input never hurts the server: each answered with the right status and OpenAI's error schema."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.server.live import MODEL_NAME, TINY_MAX_MODEL_LEN, start_server

MSGS = [{"role": "user", "content": "hello"}]
KEY = "sekret-key"


def check_error(e: openai.APIStatusError, status: int, param: str | None = None, *words: str) -> str:
    assert e.status_code == status
    body = e.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    err = body["error"]
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param
    for w in words:
        assert w in err["message"], (w, err["message"])
    assert "Traceback" not in e.response.text
    return err["message"]


@pytest.mark.parametrize(
    "kw, param, words",
    [
        (dict(max_tokens=-5), "max_tokens", ()),
        (dict(max_tokens=0), "max_tokens", ()),
        (dict(max_tokens=10**7), "max_tokens", (str(TINY_MAX_MODEL_LEN), "10000")),
        (dict(temperature=3.5), "temperature", ()),
        (dict(temperature=-1), "temperature", ()),
        (dict(top_p=0), "top_p", ()),
        (dict(n=0), "n", ()),
        (dict(presence_penalty=5), "presence_penalty", ()),
        (dict(top_logprobs=3), "top_logprobs", ()),
        (dict(logprobs=True, top_logprobs=50), "top_logprobs", ()),
        (dict(extra_body={"temperature": "hot"}), "temperature", ("hot",)),
        (dict(extra_body={"n": [1]}), "n", ()),
        (dict(stop=[""]), "stop", ()),
        (dict(extra_body={"top_k": -3}), "top_k", ()),
        (
            dict(
                tool_choice={"type": "function", "function": {"name": "g"}},
                tools=[{"type": "function", "function": {"name": "f"}}],
            ),
            "tool_choice",
            ("'g'", "'f'"),
        ),
        (dict(stream_options={"include_usage": True}), "stream_options", ()),
        (dict(logit_bias={"999999": 10}), "logit_bias", ("999999", "out of vocabulary")),
        (dict(logit_bias={"5": 500}), "logit_bias", ()),
        (dict(response_format={"type": "xml"}), "response_format", ("xml",)),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
            "response_format",
            ("nope",),
        ),
        (dict(extra_body={"guided_regex": "(a"}), "guided_regex", ()),
    ],
)
def test_chat_bad_params_are_400(client, kw, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=kw.pop("messages", MSGS), **kw)
    check_error(e.value, 400, param, *words)


@pytest.mark.parametrize(
    "messages, param",
    [
        ("hi", "messages"),
        ([], "messages"),
        ([{"role": "", "content": "hi"}], "messages"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages"),
    ],
)
def test_bad_messages_are_400(client, messages, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=messages)
    check_error(e.value, 400, param)


def test_prompt_too_long_names_both_numbers(server, client):
    long_text = " ".join(["word"] * 400)
    n = len(server.engine.parts.loaded.tokenizer.encode(long_text))
    assert n > TINY_MAX_MODEL_LEN
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=long_text, max_tokens=1)
    check_error(e.value, 400, "prompt", str(n), str(TINY_MAX_MODEL_LEN))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": long_text}])
    check_error(e.value, 400, "messages", str(TINY_MAX_MODEL_LEN))
    # prompt + max_tokens over the limit: vLLM's 400, with prompt, completion and limit
    ids = server.engine.parts.loaded.tokenizer.encode(long_text)[:100]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=TINY_MAX_MODEL_LEN)
    check_error(e.value, 400, "max_tokens", str(len(ids)), str(TINY_MAX_MODEL_LEN), str(len(ids) + TINY_MAX_MODEL_LEN))


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(prompt="x", suffix="y"), "suffix"),
        (dict(prompt="x", extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
        (dict(prompt=[5, 10**6]), "prompt"),
        (dict(prompt=[]), "prompt"),
        (dict(prompt="x", logprobs=21), "logprobs"),
        (dict(prompt="x", best_of=3), "best_of"),
    ],
)
def test_completion_bad_params_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, **kw)
    check_error(e.value, 400, param)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=MSGS)
    check_error(e.value, 404, None, "gpt-9")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    check_error(e.value, 404)


def test_malformed_json_unknown_route_wrong_method(server):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        content=b'{"model": "x", "messages": [',
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(
        server.url + "/v1/completions",
        content=b"not json at all",
        timeout=10,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.get(server.url + "/v1/nothing-here", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(server.url + "/v1/chat/completions", timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_unknown_fields_are_ignored(client):
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=MSGS, max_tokens=2, extra_body={"some_future_field": 1, "another": "x"}
    )
    assert r.usage.completion_tokens >= 1


def test_handler_bug_is_500_without_traceback_and_server_keeps_serving(server, client, monkeypatch):
    from ember.server.chat import ChatHandler

    def broken(self, req):
        raise RuntimeError("secret internals /etc/passwd")

    monkeypatch.setattr(ChatHandler, "_prompt", broken)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2)
    msg = check_error(e.value, 500)
    assert "secret" not in e.value.response.text and "RuntimeError" not in e.value.response.text
    assert "internal" in msg
    monkeypatch.undo()
    assert client.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2).usage.completion_tokens >= 1
    server.wait_idle()


# -- a second server: API key, one running sequence, one waiting slot ------------------------------


@pytest.fixture(scope="module")
def strict(tiny_qwen3):
    live = start_server(tiny_qwen3, api_key=KEY, max_num_seqs=1, max_waiting_requests=1)
    yield live
    live.stop()


def test_api_key(strict):
    good = strict.client(api_key=KEY)
    assert good.chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError) as e:
        strict.client(api_key="wrong").chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2)
    check_error(e.value, 401)
    with pytest.raises(openai.AuthenticationError):
        strict.client(api_key="wrong").models.list()
    r = httpx.post(strict.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # health, version and metrics stay open (probes and scrapers carry no key)
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(strict.url + path, timeout=10).status_code == 200


def test_full_waiting_queue_is_503(strict, monkeypatch):
    engine = strict.engine
    real_step = engine.step

    def slow_step():
        time.sleep(0.01)
        return real_step()

    monkeypatch.setattr(engine, "step", slow_step)
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL_NAME, "messages": MSGS, "max_tokens": 200, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30, headers=headers) as http:
        with http.stream("POST", strict.url + "/v1/chat/completions", json=body) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")  # role chunk
            assert '"content"' in next(l for l in lines if l)  # a token: it is running
            with http.stream("POST", strict.url + "/v1/chat/completions", json=body) as waiting:
                assert waiting.status_code == 200  # accepted into the one waiting slot
                with pytest.raises(openai.APIStatusError) as e:
                    strict.client(api_key=KEY).chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2)
                check_error(e.value, 503, None, "overloaded", "--max-waiting-requests 1")
    monkeypatch.undo()
    strict.wait_idle()
    # the server serves again once the queue drains
    assert strict.client(api_key=KEY).chat.completions.create(model=MODEL_NAME, messages=MSGS, max_tokens=2).choices
