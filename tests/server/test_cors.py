"""CORS, vLLM's flags: no cross-origin access by default; --allowed-origins lets a browser UI in. The
flags as the launcher reads them, and a browser's preflight against live servers."""

from __future__ import annotations

import argparse

import httpx
import pytest

from ember.errors import ConfigError
from ember.server.launcher import add_server_args, cors_options
from tests.server.live import start_server

UI = "http://localhost:3000"


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    return parser.parse_args(["some/model", *argv])


def test_cors_flags_default_to_no_cross_origin_access():
    assert cors_options(_serve_args()) == {
        "allowed_origins": [],
        "allowed_methods": ["*"],
        "allowed_headers": ["*"],
        "allow_credentials": False,
    }
    got = cors_options(
        _serve_args(
            "--allowed-origins",
            '["http://localhost:3000"]',
            "--allowed-methods",
            '["GET", "POST"]',
            "--allow-credentials",
        )
    )
    assert got["allowed_origins"] == ["http://localhost:3000"] and got["allowed_methods"] == ["GET", "POST"]
    assert got["allow_credentials"] is True


@pytest.mark.parametrize(
    "flag, value, says",
    [
        ("--allowed-origins", "http://localhost:3000", "is not JSON"),
        ("--allowed-headers", '{"a": 1}', "not a JSON list of strings"),
        ("--allowed-methods", "[1, 2]", "not a JSON list of strings"),
    ],
)
def test_a_bad_cors_value_is_refused_naming_the_flag(flag, value, says):
    with pytest.raises(ConfigError) as e:
        cors_options(_serve_args(flag, value))
    assert str(e.value).startswith(flag) and says in str(e.value)


def preflight(url: str, origin: str = UI) -> httpx.Response:
    """What a browser asks before a cross-origin POST with a JSON body and an API key."""
    return httpx.options(
        url + "/v1/chat/completions",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )


@pytest.mark.engine
def test_browsers_get_cross_origin_access_only_when_origins_are_given(tiny_model_dir):
    closed = start_server(tiny_model_dir("qwen3"), api_key="k")
    try:
        r = preflight(closed.url)
        assert "access-control-allow-origin" not in r.headers  # the browser refuses the call
        r = httpx.get(closed.url + "/health", headers={"Origin": UI})
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    finally:
        closed.stop()
    opened = start_server(
        tiny_model_dir("qwen3"), api_key="k", server_knobs={"allowed_origins": [UI], "allowed_methods": ["GET", "POST"]}
    )
    try:
        r = preflight(opened.url)  # answered before the API key is asked for: browsers send none with it
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
        assert "POST" in r.headers["access-control-allow-methods"]
        assert preflight(opened.url, "http://elsewhere.example").status_code == 400  # not an allowed origin
        r = httpx.get(opened.url + "/v1/models", headers={"Origin": UI, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == UI
    finally:
        opened.stop()
