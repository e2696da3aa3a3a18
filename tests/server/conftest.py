"""Fixtures for the API tests; the live-server helper is tests/server/live.py."""

from __future__ import annotations

import pytest

from tests.server.live import start_server


@pytest.fixture(scope="session")
def tiny_qwen3(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="session")
def server(tiny_qwen3):
    """The main server: no API key, warmup on (as `ember serve` runs by default)."""
    live = start_server(tiny_qwen3, warmup=True)
    yield live
    live.stop()


@pytest.fixture
def client(server):
    return server.client()
