"""Servers a benchmark launches and talks to over HTTP: `ember serve` as `ember bench serve` runs it (waited for
until steady), and the starts `ember bench startup | restart` time from the launch (`ember serve` or llama.cpp's
llama-server); the port, the /metrics reading and the streaming they share.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ember.errors import ConfigError
from ember.platform import usable_cores

logger = logging.getLogger("ember.bench")

PROMPT = [{"role": "user", "content": "Say hello in one short sentence."}]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def compiling(metrics_text: str) -> bool:
    """Whether an ember server's /metrics says a background compile is running (another server: no)."""
    return any(
        line.startswith("ember:executor_compiling") and float(line.rsplit(" ", 1)[1]) > 0
        for line in metrics_text.splitlines()
    )


def stream(url: str, body: dict):
    """POST a streaming request; yield the JSON object of every `data:` line before `data: [DONE]`."""
    import httpx

    with httpx.stream("POST", url, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


def launch_plan(args) -> tuple[str, list[str], int]:
    """(the model, its `ember serve` flags, the thread count) of a command's engine flags, as a server
    launched with them runs."""
    from ember.config.engine_args import engine_args_to_words, engine_config_from_args
    from ember.default_model import default_model_path

    config = engine_config_from_args(args)
    model = str(config.model or default_model_path())
    return model, engine_args_to_words(args), config.num_threads or usable_cores()


def serve_argv(flags: list[str], port: int) -> list[str]:
    """`ember serve FLAGS` on 127.0.0.1:port, as this Python runs it."""
    return [
        sys.executable,
        "-m",
        "ember.entrypoints.cli",
        "serve",
        *flags,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-log-requests",
    ]


class Server:
    """A server process launched on 127.0.0.1:port, its output in a temporary log file; `command` names it in
    messages and results. Times are seconds since the launch (t0)."""

    def __init__(self, argv: list[str], port: int, command: str, env: dict | None = None, compiles: bool = True):
        self.url, self.command, self.compiles = f"http://127.0.0.1:{port}", command, compiles
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ember-bench-server-", suffix=".log", delete=False)
        logger.info("bench: starting %s (log: %s)", command, self.log.name)
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.pid = self.proc.pid

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def _alive(self) -> None:
        if self.proc.poll() is not None:
            raise ConfigError(
                f"`{self.command}` exited with status {self.proc.returncode}; its log ends:\n{self.log_tail()}"
            )

    def health(self, timeout: float, steady: bool = False, poll: float = 0.05) -> float:
        """Launch -> /health answered 200 and (steady) no background compile is running (the /metrics gauge
        ember:executor_compiling is 0: a benchmark measures the steady state). Raises with the server's log when
        it died or was not ready within `timeout` seconds."""
        import httpx

        deadline = time.monotonic() + timeout
        healthy = False
        while time.monotonic() < deadline:
            self._alive()
            try:
                healthy = healthy or httpx.get(self.url + "/health", timeout=2).status_code == 200
                if healthy and (not steady or not compiling(httpx.get(self.url + "/metrics", timeout=5).text)):
                    return time.monotonic() - self.t0
            except httpx.TransportError:
                pass
            time.sleep(poll)
        raise ConfigError(f"`{self.command}` was not ready within {timeout:g}s; its log ends:\n{self.log_tail()}")

    def first_token(self) -> float:
        """Launch -> the first streamed content token of one chat request (to the model /v1/models names)."""
        import httpx

        model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {"model": model, "messages": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}
        for chunk in stream(self.url + "/v1/chat/completions", body):
            choices = chunk.get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                return time.monotonic() - self.t0
        raise ConfigError("the stream ended without a content token")

    def compiled(self, timeout: float) -> float | None:
        """Launch -> ember's background compile done (None for a server without one, or after `timeout` seconds
        from the launch)."""
        import httpx

        if not self.compiles:
            return None
        while time.monotonic() - self.t0 < timeout:
            self._alive()
            if not compiling(httpx.get(self.url + "/metrics", timeout=5).text):
                return time.monotonic() - self.t0
            time.sleep(0.5)
        return None

    def stop(self, keep_log: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not keep_log:
            os.unlink(self.log.name)


def ember_start(flags: list[str], cache_dir: str | None, port: int) -> Server:
    """`ember serve FLAGS` as a user starts it; cache_dir: torch's compile cache folder for this start (None: the
    one a user's start finds)."""
    env = dict(os.environ) if cache_dir is None else dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    env.pop("EMBER_AUTO_COMPILE", None)  # what a user gets
    argv = serve_argv(flags, port)
    return Server(argv, port, shlex.join(["ember", "serve", *argv[4:]]), env)


def llama_server_start(binary: str, model: str, threads: int, port: int) -> Server:
    argv = [
        binary,
        "-m",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(threads),
        "-c",
        "4096",
        "--log-disable",
    ]
    return Server(argv, port, shlex.join(argv), dict(os.environ), compiles=False)
