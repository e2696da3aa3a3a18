"""Live servers for the API tests: the real app on uvicorn in a thread, on a free port, over a
tiny random Qwen3 model (fp32, one thread, small KV pool, max_model_len 256)."""

from __future__ import annotations

import socket
import threading
import time

import httpx

TINY_MAX_MODEL_LEN = 256
MODEL_NAME = "tiny-qwen3"


class LiveServer:
    def __init__(self, app, server, thread, port: int):
        self.app = app
        self.server = server
        self.thread = thread
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.async_engine = app.state.engine
        self.engine = app.state.engine.engine
        self.metrics = app.state.metrics

    def client(self, api_key: str = "none", **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kw)

    def async_client(self, api_key: str = "none", **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=120, **kw)

    def wait_idle(self, timeout: float = 20.0) -> None:
        """Until the engine has nothing in flight and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            kv = self.engine.parts.kv
            if not self.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {self.engine.stats()}")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def start_server(
    model_dir: str,
    *,
    api_key: str | None = None,
    warmup: bool = False,
    max_waiting_requests: int = 256,
    chat_template: str | None = None,
    wait_ready: bool = True,
    tokenizer_info: bool = False,
    server_knobs: dict | None = None,
    root_path: str = "",
    **engine_knobs,
) -> LiveServer:
    import uvicorn

    from ember.config import EngineConfig
    from ember.engine.async_engine import AsyncLLMEngine
    from ember.engine.engine import LLMEngine
    from ember.server.api import build_app
    from ember.server.serving import ServerConfig

    knobs = dict(
        model=model_dir, dtype="float32", num_threads=1, kv_cache_memory=0.01, max_model_len=TINY_MAX_MODEL_LEN
    )
    knobs.update(engine_knobs)
    engine = LLMEngine(EngineConfig(**knobs))
    async_engine = AsyncLLMEngine(engine, max_waiting_requests=max_waiting_requests, warmup=warmup)
    app = build_app(
        async_engine,
        ServerConfig(
            served_model_names=[MODEL_NAME, "alias"],
            model_root=model_dir,
            api_key=api_key,
            chat_template=chat_template,
            enable_tokenizer_info_endpoint=tokenizer_info,
            root_path=root_path,
            **(server_knobs or {}),
        ),
    )
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True, name=f"uvicorn-{port}")
    thread.start()
    live = LiveServer(app, server, thread, port)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            status = httpx.get(live.url + "/health", timeout=2).status_code
            if status == 200 or not wait_ready:
                return live
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    live.stop()
    raise RuntimeError("server did not become ready")
