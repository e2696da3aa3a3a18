"""The Messages API's routes on ember's app: POST /v1/messages (JSON, or SSE when `stream` is true) and
POST /v1/messages/count_tokens, behind the same API-key check as every /v1 route.

Their errors are in Anthropic's shape: ember.server.api's handlers pick it by path (errors.py); the
OpenAPI document says so, route by route.
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from ember.server.anthropic.handler import MessagesHandler
from ember.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from ember.server.chat import ChatHandler
from ember.server.serving import Serving, http_answer

MESSAGES, COUNT_TOKENS = "/v1/messages", "/v1/messages/count_tokens"

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": {"type": "string"}, "message": {"type": "string"}},
        },
    },
}
_WHY = {
    400: "invalid request: a bad field, malformed JSON, an image block, a prompt that does not fit",
    401: "missing or wrong API key (x-api-key or Authorization: Bearer), when the server has one",
    404: "no such route",
    500: "a bug in the server (no details; the server log has them)",
    503: "overloaded, warming up or shutting down (overloaded_error)",
}
ERROR_RESPONSES = {
    code: {"description": why, "content": {"application/json": {"schema": _ERROR_SCHEMA}}} for code, why in _WHY.items()
}
_STREAMS = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def add_routes(app: FastAPI, chat: ChatHandler, serving: Serving, dependencies: list) -> None:
    handler = MessagesHandler(chat, serving)

    @app.post(MESSAGES, dependencies=dependencies, responses={**ERROR_RESPONSES, **_STREAMS})
    async def messages(body: MessagesRequest, request: Request):
        return await http_answer(handler.create(body, request.receive))

    @app.post(COUNT_TOKENS, dependencies=dependencies, responses=ERROR_RESPONSES)
    async def count_tokens(body: CountTokensRequest):
        return handler.count_tokens(body)
