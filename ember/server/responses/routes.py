"""POST /v1/responses and POST /v1/responses/input_tokens, on the app's chat handler.

A Responses request is translated to a chat request (translate.py), answered by the chat path
(ChatHandler.submit, then .whole or .chunk_dicts: one engine path for both APIs), and its answer
translated back (output.py, stream.py). Refusals on the chat side name the Responses field the
client sent (`max_output_tokens`, not `max_tokens`). A client that goes away aborts the engine
work: the whole answer is awaited under unless_disconnected, a stream's generator closes the chat
stream when it is closed.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from fastapi import FastAPI, Request

from ember.errors import ParamError
from ember.server.chat import ChatHandler
from ember.server.protocol import ChatCompletionRequest, TokenizeRequest
from ember.server.responses.output import ResponseBuilder, whole_response
from ember.server.responses.protocol import InputTokensRequest, ResponsesRequest
from ember.server.responses.stream import response_events
from ember.server.responses.translate import CHAT_TO_RESPONSES_PARAM, to_chat
from ember.server.serving import Serving, http_answer, unless_disconnected
from ember.server.tokenize import tokenize

logger = logging.getLogger("ember.server")

RESPONSES, INPUT_TOKENS = "/v1/responses", "/v1/responses/input_tokens"

# /openapi.json: /v1/responses answers JSON, or server-sent events when `stream` is true
STREAMS = {200: {"content": {"text/event-stream": {"schema": {"type": "string"}}}}}


class ResponsesEndpoint:
    def __init__(self, chat: ChatHandler, serving: Serving):
        self.chat = chat
        self.serving = serving

    async def create(self, req: ResponsesRequest, receive) -> dict | AsyncIterator[str]:
        """The Response (a dict), or the SSE lines of a stream; refusals raise before anything is sent."""
        _log_ignored(req)
        translation = to_chat(req)
        streams, ctx = await self._submit(translation.chat)
        # the engine request's hex in the id, so the server log's lines about it can be found
        response_id = "resp_" + ctx.rid.removeprefix("chatcmpl-")
        builder = ResponseBuilder(req, translation, response_id, ctx.created, ctx.model, self._count_tokens)
        if req.stream:
            return response_events(builder, self.chat.chunk_dicts(streams, ctx), ctx)
        answer = await unless_disconnected(self.chat.whole(streams, ctx), receive)
        return whole_response(builder, answer, ctx.cached)

    def input_tokens(self, req: InputTokensRequest) -> dict:
        """The prompt's token count: the chat messages /v1/responses would answer, through the
        template, counted as /tokenize counts them (which is how the chat path tokenizes)."""
        _log_ignored(req)
        chat = to_chat(req).chat
        use_tools = bool(chat.tools) and chat.tool_choice != "none"  # the chat path's rule for the prompt
        try:
            kwargs = self.serving.template_kwargs(chat.chat_template_kwargs, chat.reasoning_effort)
        except ParamError as e:
            e.param = CHAT_TO_RESPONSES_PARAM.get(e.param, e.param)
            raise
        body = TokenizeRequest(
            model=req.model,
            messages=chat.messages,
            tools=chat.tools if use_tools else None,
            chat_template_kwargs=kwargs,
        )
        return {"object": "response.input_tokens", "input_tokens": tokenize(self.serving, body)["count"]}

    async def _submit(self, chat: ChatCompletionRequest):
        try:
            return await self.chat.submit(chat)
        except ParamError as e:
            e.param = CHAT_TO_RESPONSES_PARAM.get(e.param, e.param)
            raise

    def _count_tokens(self, text: str) -> int:
        return len(self.serving.tokenizer.encode(text, add_special_tokens=False))


def _log_ignored(req: InputTokensRequest) -> None:
    # a count may be sent the whole create body: the create fields it does not need are no news
    ignored = [name for name in req.ignored_fields() if name not in ResponsesRequest.model_fields]
    if ignored:
        logger.warning("responses request fields ignored (not known to ember): %s", ", ".join(ignored))


def add_routes(app: FastAPI, chat: ChatHandler, serving: Serving, dependencies: list) -> None:
    """The Responses API's routes on app, behind the /v1 routes' dependencies (the API key)."""
    endpoint = ResponsesEndpoint(chat, serving)

    @app.post(RESPONSES, dependencies=dependencies, responses=STREAMS)
    async def create_response(body: ResponsesRequest, request: Request):
        return await http_answer(endpoint.create(body, request.receive))

    @app.post(INPUT_TOKENS, dependencies=dependencies)
    async def count_input_tokens(body: InputTokensRequest):
        return endpoint.input_tokens(body)
