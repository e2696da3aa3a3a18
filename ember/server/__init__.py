"""The OpenAI-compatible HTTP server (`ember serve`), which speaks Anthropic's Messages API too.

  api.py          FastAPI app: routes, API key, errors in OpenAI's shape (Anthropic's on its routes), request counting, SSE
  chat.py         /v1/chat/completions     completions.py   /v1/completions
  chat_blocks.py  a chat answer as blocks (open / delta / close): what the agent protocols translate
  anthropic/      Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over the chat path
  serving.py      what both share: settings, request -> SamplingParams, submit, disconnects
  protocol.py     pydantic request schemas and the JSON shapes of answers
  tool_parsers/   <tool_call> parsing (Hermes JSON, Qwen3-Coder XML), whole and as streaming deltas
  logprobs.py     logprobs in the chat (current) and completions (legacy) shapes
  metrics.py      Prometheus metrics (one registry per app)
  structured.py   response_format / structured_outputs / guided_* -> StructuredOutputsParams
  reasoning_effort.py  OpenAI's reasoning_effort fitted to the chat template's values
  reasoning_choice.py  the reasoning parser: --reasoning-parser's, or qwen3 where the template always thinks
  tokenize.py     /tokenize, /detokenize, /tokenizer_info
  openapi.py      the /openapi.json document, as the routes really answer
  launcher.py     the `ember serve` flags (engine flags + the server's own, vLLM's names; CORS)
  responses/      OpenAI's Responses API (/v1/responses, /v1/responses/input_tokens) over the chat path
The engine side is ember/engine/async_engine.py (one background step loop, a queue per request).
"""
