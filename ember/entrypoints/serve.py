"""`ember serve` and `python -m ember.entrypoints.openai.api_server`: parsed flags -> engine -> uvicorn.

The flags are ember/server/launcher.py's (every engine flag, and the server's own under vLLM's
names). The model is loaded before the port opens, so a bad model or flag fails the command with
its message instead of leaving a half-started server.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import uvicorn

from ember.config.engine_args import engine_config_from_args
from ember.errors import ConfigError
from ember.server.launcher import VLLM_SWITCHES, cors_options
from ember.server.sampling_defaults import AUTO as AUTO_DEFAULTS
from ember.server.sampling_defaults import load_sampling_defaults, parse_override

logger = logging.getLogger("ember.server")

# after the shutdown timeout's aborts: time for the aborted answers to reach their clients
ABORT_FLUSH_SECONDS = 5.0


def _model_name(args, engine) -> list[str]:
    if args.served_model_name:
        return list(args.served_model_name)
    given = getattr(args, "model_pos", None) or getattr(args, "model", None)
    if given:
        return [given]
    base = os.path.basename(str(engine.parts.loaded.path).rstrip("/"))
    return [base.split(".")[0] if base.endswith(".gguf") else base]


def _chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:
        raise ConfigError(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def build_server(args):
    """(DrainingServer, app) for parsed args; loads the model."""
    from ember.engine.async_engine import AsyncLLMEngine
    from ember.engine.engine import LLMEngine
    from ember.server.api import build_app
    from ember.server.metrics import ServerMetrics
    from ember.server.serving import ServerConfig

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be in 0..65535 (got {args.port})")
    if args.shutdown_timeout < 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds (got {args.shutdown_timeout:g})")
    if args.max_waiting_requests < 1:
        raise ConfigError(f"--max-waiting-requests must be >= 1 (got {args.max_waiting_requests})")
    template = _chat_template(args.chat_template)
    cors = cors_options(args)
    override = parse_override(args.override_generation_config)
    # vllm or a folder: read (and checked) before the model loads; auto needs the loaded model's folder
    sampling_defaults = None
    if args.generation_config != AUTO_DEFAULTS:
        sampling_defaults = load_sampling_defaults(args.generation_config, "", override)
    # Build the engine on the thread that will step it (see AsyncLLMEngine's executor).
    engine_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ember-engine")
    engine = engine_thread.submit(LLMEngine, engine_config_from_args(args), defer_compile=True).result()
    names = _model_name(args, engine)
    switches = [flag[2:].replace("-", "_") for flag in VLLM_SWITCHES]
    if sampling_defaults is None:
        sampling_defaults = load_sampling_defaults(AUTO_DEFAULTS, str(engine.parts.loaded.path), override)
    if sampling_defaults:
        logger.info("default sampling for what a request leaves unset: %s", sampling_defaults)
    config = ServerConfig(
        served_model_names=names,
        model_root=str(engine.parts.loaded.path),
        sampling_defaults=sampling_defaults,
        api_key=args.api_key or os.environ.get("EMBER_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
        chat_template=template,
        log_requests=not args.disable_log_requests,
        root_path=args.root_path,
        tool_call_parser=args.tool_call_parser,
        **cors,
        **{name: getattr(args, name) for name in switches},
    )
    metrics = ServerMetrics.for_engine(names[0], engine)
    metrics.watch_compile(engine)
    metrics.watch_experts(engine)
    async_engine = AsyncLLMEngine(
        engine,
        max_waiting_requests=args.max_waiting_requests,
        warmup=args.warmup,
        stats=metrics,
        executor=engine_thread,
    )
    app = build_app(async_engine, config, metrics)
    uv = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        timeout_graceful_shutdown=args.shutdown_timeout + ABORT_FLUSH_SECONDS,
        access_log=args.uvicorn_log_level in ("info", "debug", "trace"),
    )
    return DrainingServer(uv, app, args.shutdown_timeout), app


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with vLLM's --shutdown-timeout: at the first SIGTERM / SIGINT new requests get a
    503 (uvicorn also stops listening), those in flight get `shutdown_timeout` seconds, then the engine
    aborts them and each answer ends with finish_reason "abort" -- before uvicorn's own deadline, so no
    handler is cancelled mid-answer (a 500 and a traceback)."""

    def __init__(self, config, app, shutdown_timeout: float):
        super().__init__(config)
        self.app = app
        self.shutdown_timeout = shutdown_timeout
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig, frame) -> None:
        serving = self.app.state.serving
        if not serving.draining:
            serving.draining = True
            logger.info(
                "ember serve: shutting down; %s",
                "aborting the requests in flight"
                if not self.shutdown_timeout
                else f"giving the requests in flight {self.shutdown_timeout:g}s",
            )
            self._timer = threading.Timer(self.shutdown_timeout, self.app.state.engine.abort_all)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)


def run_server(args) -> None:
    t0 = time.monotonic()
    server, app = build_server(args)
    auth = "API key required" if app.state.serving.config.api_key else "no API key"
    if args.host not in ("127.0.0.1", "localhost", "::1") and not app.state.serving.config.api_key:
        logger.warning("listening on %s without --api-key: anyone who can reach this port can use the model", args.host)
    compiling = app.state.engine.executor_state
    logger.info(
        "ember serve: %s at http://%s:%d/v1 (%s), engine built in %.1fs%s; decode steps: %s",
        ", ".join(app.state.serving.config.served_model_names),
        args.host,
        args.port,
        auth,
        time.monotonic() - t0,
        "; warming up" if args.warmup else "",
        compiling,
    )
    # SIGTERM asks for a stop: once uvicorn's graceful shutdown is done it re-raises the signal it caught,
    # and with the default handler the process would die of it (status 143, which `make run` reports as
    # "Terminated", exit 2). Handled, the re-raise ends here and a finished shutdown exits 0, as Ctrl-C does.
    if threading.current_thread() is threading.main_thread():  # where uvicorn installs its handlers too
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn shut down gracefully, then re-raised Ctrl-C
        pass
    logger.info("ember serve: stopped")
