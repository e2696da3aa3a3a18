"""Launch lines: `ember serve` flags, vLLM's `python -m ember.entrypoints.openai.api_server`, and a
smoke test against the embedded default model."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ember.errors import ConfigError, DefaultModelMissingError

TINY = ["--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "0.01", "--max-model-len", "256"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_flags_defaults_and_engine_flags():
    from ember.entrypoints.cli import build_parser

    args = build_parser().parse_args(["serve", "some/model", "--max-num-seqs", "4", "--no-enable-prefix-caching"])
    assert (args.host, args.port, args.api_key, args.warmup) == ("127.0.0.1", 8000, None, True)
    assert args.model_pos == "some/model" and args.max_num_seqs == 4 and args.enable_prefix_caching is False
    assert args.max_waiting_requests == 256
    args = build_parser().parse_args(["serve", "--no-warmup", "--served-model-name", "a", "b", "--host", "0.0.0.0"])
    assert args.warmup is False and args.served_model_name == ["a", "b"] and args.host == "0.0.0.0"


def test_bad_server_flags_fail_before_loading():
    from ember.entrypoints.cli import build_parser
    from ember.entrypoints.serve import build_server

    for argv in (
        ["serve", "--port", "70000"],
        ["serve", "--max-waiting-requests", "0"],
        ["serve", "--chat-template", "no-such-file"],
        ["serve", "--allowed-origins", "http://localhost:3000"],  # not a JSON list
        ["serve", "--override-generation-config", '{"top_p": 2}'],
        ["serve", "--generation-config", "/no/such/folder"],
    ):
        with pytest.raises(ConfigError):
            build_server(build_parser().parse_args(argv))


@pytest.mark.engine
def test_vllm_launch_line_in_a_subprocess(tiny_model_dir):
    port = free_port()
    env = {**os.environ, "EMBER_API_KEY": "k123"}
    cmd = [
        sys.executable,
        "-m",
        "ember.entrypoints.openai.api_server",
        "--model",
        tiny_model_dir("qwen3"),
        *TINY,
        "--port",
        str(port),
        "--served-model-name",
        "Qwen/Qwen3-0.6B",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise AssertionError("server did not become ready")
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k123"}).json()
        assert [m["id"] for m in models["data"]] == ["Qwen/Qwen3-0.6B"]
        r = httpx.post(
            url + "/v1/completions",
            headers={"Authorization": "Bearer k123"},
            json={"model": "Qwen/Qwen3-0.6B", "prompt": "hi", "max_tokens": 3, "ignore_eos": True},
        )
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert "warmup:" in out and "ready" in out  # warmup ran and said how long it took
    assert proc.returncode == 0, out


@pytest.mark.engine
def test_default_model_says_paris():
    from ember.default_model import default_model_path
    from tests.server.live import start_server

    try:
        default_model_path()
    except DefaultModelMissingError as e:
        pytest.skip(str(e))
    import torch

    threads = torch.get_num_threads()  # process-wide: give it back to the tests that follow
    live = start_server(None, kv_cache_memory=0.05, max_model_len=512, num_threads=None)
    try:
        r = live.client().chat.completions.create(
            model="tiny-qwen3",
            temperature=0,
            max_tokens=24,
            messages=[{"role": "user", "content": "Name the capital of France."}],
        )
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    finally:
        live.stop()
        torch.set_num_threads(threads)
