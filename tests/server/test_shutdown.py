"""--shutdown-timeout on a real `ember serve` process: SIGTERM stops new work, lets the requests in flight
finish (or, at 0, aborts them with finish_reason "abort"), and the process exits cleanly: no 500, no
traceback in its log."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.server.test_launch import TINY, free_port

pytestmark = pytest.mark.engine  # every test here builds an engine


def _launch(model: str, timeout_s: float):
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "ember.entrypoints.cli",
        "serve",
        model,
        *TINY,
        "--port",
        str(port),
        "--served-model-name",
        "m",
        "--no-warmup",
        "--max-num-seqs",
        "4",
        "--shutdown-timeout",
        str(timeout_s),
    ]
    proc = subprocess.Popen(cmd, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not become ready")


async def _in_flight_then_sigterm(proc, url: str, n: int = 24):
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
    tasks = [
        asyncio.create_task(
            client.completions.create(model="m", prompt="story", max_tokens=240, extra_body={"ignore_eos": True})
        )
        for _ in range(n)
    ]
    await asyncio.sleep(1.5)  # 24 answers of 240 tokens, 4 at a time: most are still running
    proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.3)
    late = None
    try:
        await client.completions.create(model="m", prompt="late", max_tokens=2)
    except (openai.APIStatusError, openai.APIConnectionError) as e:
        late = e
    return await asyncio.gather(*tasks, return_exceptions=True), late


def _exit_log(proc) -> str:
    try:
        out, _ = proc.communicate(timeout=40)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError("the server did not exit:\n" + out)
    return out


@pytest.mark.parametrize("timeout_s", [30, 0])
def test_sigterm_drains_or_aborts_cleanly(tiny_model_dir, timeout_s):
    proc, url = _launch(tiny_model_dir("qwen3"), timeout_s)
    try:
        results, late = asyncio.run(_in_flight_then_sigterm(proc, url))
    finally:
        t0 = time.monotonic()
        log = _exit_log(proc)
        exit_s = time.monotonic() - t0
    assert late is not None  # new work is refused once the shutdown began (503 or a closed port)
    if isinstance(late, openai.APIStatusError):
        assert late.status_code == 503
    assert all(not isinstance(r, BaseException) for r in results), results
    reasons = {r.choices[0].finish_reason for r in results}
    assert reasons == ({"length"} if timeout_s else {"abort"} | (reasons & {"length"}))
    if timeout_s:  # answers were still being written after the signal, and finished
        assert log.rindex("completion tokens") > log.index("shutting down"), log
    else:
        assert "abort" in reasons and exit_s < 10
    assert proc.returncode == 0, log  # a finished graceful shutdown exits 0 (uvicorn's re-raised SIGTERM is handled)
    assert "ember serve: stopped" in log
    assert "Traceback" not in log and "Exception in ASGI" not in log, log
