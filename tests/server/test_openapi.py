"""/openapi.json documents what the server answers (what schemathesis, in vLLM's schema test, checks): each
route's real status codes and media types are the documented ones, and FastAPI's 422 (ember answers 400)
is nowhere."""

from __future__ import annotations

import httpx

from tests.server.live import MODEL_NAME


def _media(response: httpx.Response) -> str | None:
    ct = response.headers.get("content-type")
    return ct.split(";")[0].strip() if ct else None


def _documented(spec: dict, path: str, method: str, status: int) -> list[str]:
    responses = spec["paths"][path][method]["responses"]
    assert str(status) in responses, f"{method.upper()} {path} answers {status}, undocumented: {sorted(responses)}"
    return list((responses[str(status)].get("content") or {}).keys())


def test_every_answer_is_documented(server):
    url = server.url
    spec = httpx.get(url + "/openapi.json").json()
    assert '"422"' not in str(spec).replace("'", '"')
    chat = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("get", "/health", httpx.get(url + "/health")),
        ("get", "/metrics", httpx.get(url + "/metrics")),
        ("get", "/version", httpx.get(url + "/version")),
        ("get", "/v1/models", httpx.get(url + "/v1/models")),
        ("get", "/v1/models/{name}", httpx.get(url + "/v1/models/nope")),
        ("post", "/v1/chat/completions", httpx.post(url + "/v1/chat/completions", json=chat)),
        ("post", "/v1/chat/completions", httpx.post(url + "/v1/chat/completions", json={**chat, "stream": True})),
        ("post", "/v1/chat/completions", httpx.post(url + "/v1/chat/completions", json={"messages": "x"})),
        ("post", "/v1/chat/completions", httpx.post(url + "/v1/chat/completions", json={**chat, "model": "nope"})),
        ("post", "/v1/completions", httpx.post(url + "/v1/completions", content=b"{not json")),
        ("post", "/tokenize", httpx.post(url + "/tokenize", json={"prompt": "hi"})),
        ("post", "/detokenize", httpx.post(url + "/detokenize", json={"tokens": [-1]})),
    ]
    statuses = set()
    for method, path, r in cases:
        media = _documented(spec, path, method, r.status_code)
        assert _media(r) in media or (not media and _media(r) is None), (path, r.status_code, _media(r), media)
        statuses.add(r.status_code)
    assert {200, 400, 404} <= statuses
