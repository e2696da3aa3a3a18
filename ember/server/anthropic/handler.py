"""POST /v1/messages and /v1/messages/count_tokens over the chat path: a Messages request is translated
(translate.py), submitted as the chat request it becomes, and its answer written as a Message (message.py)
or its events (stream.py).

Any model name is served by the one model this server has: Anthropic clients name Claude models (Claude
Code's main model, and `claude-haiku-*` for its side tasks), which a local server cannot have. The
answer carries the name the client sent; the first request under each name is logged.
"""

from __future__ import annotations

import logging
from typing import AsyncIterator

from ember.server import tokenize
from ember.server.anthropic.message import message_id, whole_message
from ember.server.anthropic.protocol import CountTokensRequest, MessagesRequest
from ember.server.anthropic.stream import MessageEvents, message_stream
from ember.server.anthropic.translate import to_chat_request
from ember.server.chat import ChatHandler
from ember.server.protocol import TokenizeRequest
from ember.server.serving import Serving, unless_disconnected

logger = logging.getLogger("ember.server")


class MessagesHandler:
    def __init__(self, chat: ChatHandler, serving: Serving):
        self.chat = chat
        self.s = serving
        self._names_seen: set[str] = set()

    async def create(self, req: MessagesRequest, receive) -> dict | AsyncIterator[str]:
        """The whole Message, or the SSE text of its stream; raises ClientDisconnected when the client left
        before a whole answer was done (its engine work is aborted)."""
        self._note_model(req.model)
        # max_tokens capped to the context's room, not refused: Claude Code asks for 32000 and more
        streams, ctx = await self.chat.submit(to_chat_request(req), fit_max_tokens=True)
        stop_sequences = req.stop_sequences or []
        if req.stream:
            events = MessageEvents(message_id(ctx.rid), req.model, stop_sequences)
            return message_stream(self.chat.chunk_dicts(streams, ctx), ctx, events)
        answer = await unless_disconnected(self.chat.whole(streams, ctx), receive)
        return whole_message(answer, model=req.model, cached=ctx.cached, stop_sequences=stop_sequences)

    def count_tokens(self, req: CountTokensRequest) -> dict:
        """{"input_tokens": N}: the tokens of the prompt the same Messages request gets, counted as /tokenize
        counts chat messages (the template applied; tools rendered unless tool_choice is none, as chat does)."""
        self._note_model(req.model)
        chat_req = to_chat_request(req)
        use_tools = bool(chat_req.tools) and chat_req.tool_choice != "none"
        counted = tokenize.tokenize(
            self.s,
            TokenizeRequest(
                messages=chat_req.messages,
                tools=chat_req.tools if use_tools else None,
                add_generation_prompt=chat_req.add_generation_prompt,
                continue_final_message=chat_req.continue_final_message,
                chat_template_kwargs=self.s.template_kwargs(chat_req.chat_template_kwargs, chat_req.reasoning_effort),
            ),
        )
        return {"input_tokens": counted["count"]}

    def _note_model(self, name: str) -> None:
        if name not in self._names_seen:
            self._names_seen.add(name)
            logger.info("anthropic: model %r is served by %s", name, self.s.model_name)
