"""The FastAPI app: routes, API-key check, OpenAI-shaped errors, request counting, SSE.

`build_app(async_engine, config)` returns an app whose lifespan starts the engine thread
(warmup first; /health answers 503 until it is done). Every error a client can see has
OpenAI's shape `{"error": {"message", "type", "param", "code"}}` (under /v1/messages Anthropic's,
ember.server.anthropic.errors):
400 bad parameters (pydantic's 422 and malformed JSON included), 401 bad or missing API key
on /v1/*, 404 unknown model or route, 503 overload, 500 for a bug -- with a generic message;
the traceback goes to the log only.
"""

from __future__ import annotations

import contextlib
import hmac
import importlib.metadata
import json
import logging
import time
import uuid

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember.engine.async_engine import AsyncLLMEngine
from ember.errors import AuthenticationError, EmberError, ParamError
from ember.server import openapi, tokenize
from ember.server.anthropic import errors as anthropic_errors
from ember.server.anthropic import routes as anthropic_routes
from ember.server.chat import ChatHandler
from ember.server.completions import CompletionHandler
from ember.server.metrics import CONTENT_TYPE_LATEST, ServerMetrics
from ember.server.protocol import (
    BatchChatCompletionRequest,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
    model_card,
)
from ember.server.responses.routes import INPUT_TOKENS, RESPONSES
from ember.server.responses.routes import add_routes as add_responses_routes
from ember.server.serving import ServerConfig, Serving, http_answer

logger = logging.getLogger("ember.server")

GENERATION = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/chat/completions/batch",
    "/invocations",
    anthropic_routes.MESSAGES,
    RESPONSES,
)
ENDPOINTS = (
    *GENERATION,
    "/v1/models",
    "/health",
    "/version",
    "/metrics",
    "/load",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    anthropic_routes.COUNT_TOKENS,
    INPUT_TOKENS,
)
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable_error",
}


def ember_version() -> str:
    try:
        return importlib.metadata.version("ember")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _error(status: int, message: str, param: str | None = None, type_: str | None = None) -> JSONResponse:
    return JSONResponse(
        error_body(message, type_ or _TYPES.get(status, "server_error"), status, param), status_code=status
    )


def _error_at(path: str, status: int, message: str, param: str | None = None, type_: str | None = None):
    """An error in the shape of the API that path belongs to: Anthropic's under /v1/messages, else OpenAI's."""
    if anthropic_errors.speaks_anthropic(path):
        return anthropic_errors.error_response(status, message)
    return _error(status, message, param, type_)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"the request body is not valid JSON: {ctx.get('error', err.get('msg'))}", None
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        value = err.get("input")
        got = ""
        if err.get("type") != "missing" and not isinstance(value, (dict, list)):
            got = f" (got {json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__})"
        kind = err.get("type")  # pydantic's code (greater_than_equal, ...): clients match it, as vLLM passes it on
        parts.append(
            f"{where or 'body'}: {err.get('msg')} [{kind}]{got}"
            if kind
            else f"{where or 'body'}: {err.get('msg')}{got}"
        )
        if len(parts) == 3:
            break
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return "invalid request: " + "; ".join(parts) + more, param


class _CountRequests:
    """Pure ASGI middleware (no buffering of streams): counts responses by endpoint and status and the
    generation requests in flight (`serving.server_load`, GET /load), and answers a handler bug with a
    generic 500 itself. Starlette's own 500 path re-raises to the server, which then drops the
    keep-alive connection; here the connection stays usable."""

    def __init__(self, app, metrics: ServerMetrics, request_id_headers: bool = False, serving: Serving | None = None):
        self.app = app
        self.metrics = metrics
        self.serving = serving  # its `draining` flag: a shutdown has begun, new requests get a 503
        self.request_id_headers = request_id_headers  # --enable-request-id-headers: echo or make X-Request-Id

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        started = False
        request_id = None
        headers = dict(scope.get("headers") or ())
        if self.request_id_headers:
            request_id = headers.get(b"x-request-id") or uuid.uuid4().hex.encode()
        orca = headers.get(b"endpoint-load-metrics-format") if endpoint in GENERATION else None

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start" and not started:
                started = True
                self.metrics.count_http(endpoint, message["status"])
                extra = [(b"x-request-id", request_id)] if request_id is not None else []
                if orca and (report := self.metrics.orca_header(orca.decode("latin-1"))):
                    extra.append((b"endpoint-load-metrics", report))  # ORCA load report, asked for by the client
                if extra:
                    message = {**message, "headers": [*message.get("headers", ()), *extra]}
            await send(message)

        if self.serving is not None and self.serving.draining:
            response = _error_at(
                path, 503, "the server is shutting down; send the request to another instance or retry later"
            )
            return await response(scope, receive, counting_send)
        load = self.serving is not None and endpoint in GENERATION
        if load:
            self.serving.server_load += 1  # until the last byte of the answer (a stream included) is sent
        try:
            await self.app(scope, receive, counting_send)
        except Exception as exc:  # noqa: BLE001 -- a bug in a handler: log it, answer 500, keep serving
            logger.error("unhandled error in %s %s", scope.get("method"), path, exc_info=exc)
            if started:
                raise  # mid-stream: the stream generators report errors in-band; nothing more to send
            response = _error_at(
                path, 500, "internal server error; the server log has the details", type_="server_error"
            )
            await response(scope, receive, counting_send)
        finally:
            if load:
                self.serving.server_load -= 1


def build_app(engine: AsyncLLMEngine, config: ServerConfig, metrics: ServerMetrics | None = None) -> FastAPI:
    metrics = metrics or ServerMetrics.for_engine(config.served_model_names[0], engine.engine)
    if engine.stats_listener is None:
        engine.stats_listener = metrics
    engine.structured.listener = metrics
    serving = Serving(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.shutdown()

    app = FastAPI(
        title="ember",
        version=ember_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        root_path=config.root_path,
    )
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    _add_error_handlers(app)
    _add_service_routes(app, engine, metrics)
    _add_v1_routes(app, serving, config, [Depends(_api_key_check(config))])
    anthropic_routes.add_routes(app, ChatHandler(serving), serving, [Depends(_api_key_check(config))])
    _add_tokenizer_routes(app, serving, config)
    openapi.install(app)
    app.add_middleware(
        _CountRequests, metrics=metrics, request_id_headers=config.enable_request_id_headers, serving=serving
    )
    _add_cors(app, config)
    return app


def _add_cors(app: FastAPI, config: ServerConfig) -> None:
    """vLLM's --allowed-origins & co.: browsers get cross-origin access only to the origins given (none by
    default: no CORS headers, so a browser refuses another site's calls). Added last, so it is the outermost
    layer: a preflight is answered before the API key is asked for, as browsers send none with it."""
    if not config.allowed_origins:
        return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=config.allowed_origins,
        allow_methods=config.allowed_methods,
        allow_headers=config.allowed_headers,
        allow_credentials=config.allow_credentials,
    )


def _add_error_handlers(app: FastAPI) -> None:
    """Every error in its API's shape (OpenAI's; Anthropic's under /v1/messages), with the right status (the
    server keeps serving)."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return _error_at(request.url.path, 400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return _error_at(
                request.url.path, 404, f"{request.method} {request.url.path} is not an endpoint of this server"
            )
        return _error_at(request.url.path, exc.status_code, str(exc.detail))

    @app.exception_handler(EmberError)
    async def _ember(request: Request, exc: EmberError):
        status = getattr(exc, "http_status", 400)
        return _error_at(request.url.path, status, str(exc), getattr(exc, "param", None))


def _api_key_check(config: ServerConfig):
    """A dependency of the /v1 routes: the --api-key, when one is set, as `Authorization: Bearer <key>` (OpenAI's
    clients) or `x-api-key: <key>` (Anthropic's); either header with the key lets the request in."""

    def check_key(request: Request) -> None:
        key = config.api_key
        if not key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        bearer = token.strip() if scheme.lower() == "bearer" else None
        for given in (bearer, request.headers.get("x-api-key")):
            if given is not None and hmac.compare_digest(given.strip().encode(), key.encode()):
                return
        raise AuthenticationError(
            "a valid API key is required: send the header `Authorization: Bearer <key>` or `x-api-key: <key>`"
        )

    return check_key


def _add_service_routes(app: FastAPI, engine: AsyncLLMEngine, metrics: ServerMetrics) -> None:
    """/health, /version, /metrics, /load: no API key."""

    @app.get("/health")
    async def health():
        if engine.is_ready:
            return Response(status_code=200)
        return _error(503, "ember is warming up; retry when /health answers 200")

    @app.get("/version")
    async def version():
        return {"version": ember_version()}

    @app.get("/metrics")
    async def get_metrics():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/load")
    async def load():
        """vLLM's: the generation requests in flight (for a load balancer that polls)."""
        return {"server_load": app.state.serving.server_load}


def _add_tokenizer_routes(app: FastAPI, serving: Serving, config: ServerConfig) -> None:
    """vLLM's /tokenize, /detokenize and (with --enable-tokenizer-info-endpoint) /tokenizer_info."""

    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        return tokenize.tokenize(serving, body)

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        return tokenize.detokenize(serving, body)

    if config.enable_tokenizer_info_endpoint:

        @app.get("/tokenizer_info")
        async def tokenizer_info_route():
            return tokenize.tokenizer_info(serving)


def _add_v1_routes(app: FastAPI, serving: Serving, config: ServerConfig, v1: list) -> None:
    """The OpenAI API: models, chat completions, completions; vLLM's batch chat and SageMaker's /invocations."""
    chat = ChatHandler(serving)
    completions = CompletionHandler(serving)
    created = int(time.time())
    add_responses_routes(app, chat, serving, v1)  # OpenAI's Responses API, over the chat handler

    @app.get("/v1/models", dependencies=v1)
    async def models():
        return {
            "object": "list",
            "data": [
                model_card(n, config.model_root, serving.max_model_len, created) for n in config.served_model_names
            ],
        }

    @app.get("/v1/models/{name:path}", dependencies=v1)
    async def model(name: str):
        serving.check_model(name)
        return model_card(name, config.model_root, serving.max_model_len, created)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await http_answer(chat.create(body, request.receive))

    @app.post("/v1/completions", dependencies=v1)
    async def create_completion(body: CompletionRequest, request: Request):
        return await http_answer(completions.create(body, request.receive))

    @app.post("/v1/chat/completions/batch", dependencies=v1)
    async def chat_completions_batch(body: BatchChatCompletionRequest, request: Request):
        return await http_answer(chat.create_batch(body, request.receive))

    @app.post("/invocations", dependencies=v1)
    async def invocations(request: Request):
        """SageMaker's single route (as vLLM serves it): a body with `messages` is a chat completion, one with
        `prompt` a completion."""
        try:
            body = await request.json()
        except ValueError as e:
            raise ParamError(f"the request body is not valid JSON: {e}") from None
        kind = (
            ("messages" in body and ChatCompletionRequest) or ("prompt" in body and CompletionRequest)
            if isinstance(body, dict)
            else None
        )
        if not kind:
            raise ParamError(
                "an /invocations body is a chat request (with `messages`) or a completion request (with `prompt`)"
            )
        try:
            parsed = kind.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None
        handler = chat if kind is ChatCompletionRequest else completions
        return await http_answer(handler.create(parsed, request.receive))


__all__ = ["build_app", "ServerConfig", "ParamError"]
