"""The OpenAI-compatible HTTP server (`ember serve`).

  api.py          FastAPI app: routes, API key, OpenAI-shaped errors, request counting, SSE
  chat.py         /v1/chat/completions     completions.py   /v1/completions
  serving.py      what both share: settings, request -> SamplingParams, submit, disconnects
  protocol.py     pydantic request schemas and the JSON shapes of answers
  tool_parsers/   <tool_call> parsing (Hermes JSON, Qwen3-Coder XML), whole and as streaming deltas
  logprobs.py     logprobs in the chat (current) and completions (legacy) shapes
  metrics.py      Prometheus metrics (one registry per app)
  structured.py   response_format / structured_outputs / guided_* -> StructuredOutputsParams
  tokenize.py     /tokenize, /detokenize, /tokenizer_info
  openapi.py      the /openapi.json document, as the routes really answer
  launcher.py     the `ember serve` flags (engine flags + the server's own, vLLM's names; CORS)
  responses/      OpenAI's Responses API (/v1/responses, /v1/responses/input_tokens) over the chat path
The engine side is ember/engine/async_engine.py (one background step loop, a queue per request).
"""
