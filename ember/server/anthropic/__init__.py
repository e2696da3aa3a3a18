"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), as Claude Code and the
anthropic SDK speak it: a translation over the chat path (ember.server.chat), not a second engine path.

  protocol.py   pydantic request models, lenient on the fields clients send that change nothing here
  translate.py  a Messages request -> the chat completions request that serves it (Claude Code's
                billing-header line dropped, so the prefix cache hits turn after turn)
  message.py    a whole chat answer -> a Message (content blocks, stop_reason, usage with cache reads)
  stream.py     a streamed chat answer -> Anthropic's SSE events
  errors.py     Anthropic's error shape, chosen by path for every error under /v1/messages
  handler.py    the two endpoints: translate, submit, answer; any model name served by the one model
  routes.py     add_routes(app, chat, serving, dependencies): the routes on ember's app
"""
