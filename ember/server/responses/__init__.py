"""OpenAI's Responses API (`POST /v1/responses`, `POST /v1/responses/input_tokens`), stateless, as a
translation over the chat path: the clients that speak only this API (Codex, the Agents SDK) are
answered by the same engine path as /v1/chat/completions.

  protocol.py   the request bodies and input items (pydantic), lenient on fields that change nothing
  translate.py  request -> ChatCompletionRequest (items -> messages, tools, tool_choice, text.format)
  output.py     chat answer blocks -> output items and the Response object (one builder, whole and streamed)
  stream.py     chat chunks -> the Responses SSE events, numbered
  routes.py     the two routes, on the app's ChatHandler
"""
