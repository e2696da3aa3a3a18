"""/openapi.json as ember answers: FastAPI's generated schema, corrected where the app differs from its
defaults. /health answers an empty 200 (or a 503 error), /metrics Prometheus text; a request FastAPI
would call invalid (422) is a 400 here; unknown models are 404s, a missing key a 401, overload a 503,
and the generation endpoints stream `text/event-stream` when asked. Every error body is OpenAI's shape.
Schemathesis (vLLM's schema test) checks responses against this document."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["integer", "string", "null"]},
            },
        }
    },
}
_ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
_WHY = {
    "400": "invalid request: a bad parameter, malformed JSON, a prompt that does not fit",
    "401": "missing or wrong API key (when the server has one)",
    "404": "unknown model",
    "500": "a bug in the server (no details; the server log has them)",
    "503": "overloaded, warming up or shutting down",
}
_GENERATION = ("/v1/chat/completions", "/v1/completions", "/invocations")  # the routes that stream when asked


def _error(code: str) -> dict:
    return {"description": _WHY[code], "content": {"application/json": {"schema": _ERROR_REF}}}


def _errors_for(path: str, method: str) -> list[str]:
    codes = ["500", "503"]
    if method == "post":
        codes.append("400")
    if path.startswith("/v1") or path == "/invocations":
        codes.append("401")
        if path != "/v1/models":
            codes.append("404")
    elif path in ("/tokenize", "/detokenize"):
        codes.append("404")
    return codes


def truthful_schema(app: FastAPI) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components["ErrorResponse"] = ERROR_SCHEMA
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            responses = op["responses"]
            responses.pop("422", None)
            for code in _errors_for(path, method):
                responses.setdefault(code, _error(code))
            if path in _GENERATION:
                ok = responses["200"].setdefault("content", {})
                ok["text/event-stream"] = {"schema": {"type": "string"}}
    health = schema["paths"].get("/health", {}).get("get")
    if health is not None:
        health["responses"]["200"] = {"description": "ready (an empty body)"}
    metrics = schema["paths"].get("/metrics", {}).get("get")
    if metrics is not None:
        metrics["responses"]["200"] = {
            "description": "Prometheus metrics",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    return schema


def install(app: FastAPI) -> None:
    """app.openapi() returns the corrected schema (built once)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = truthful_schema(app)
        return app.openapi_schema

    app.openapi = openapi
