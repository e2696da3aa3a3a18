"""The OpenAI-compatible HTTP server (`ember serve`).

  api.py          FastAPI app: routes, API key, OpenAI-shaped errors, request counting, SSE
  chat.py         /v1/chat/completions     completions.py   /v1/completions
  serving.py      what both share: settings, request -> SamplingParams, submit, disconnects
  protocol.py     pydantic request schemas and the JSON shapes of answers
  tool_parser.py  Qwen/Hermes <tool_call> parsing, whole and as streaming deltas
  logprobs.py     logprobs in the chat (current) and completions (legacy) shapes
  metrics.py      Prometheus metrics (one registry per app)
  launcher.py     flags, engine and uvicorn for `ember serve` / the vLLM-style entry point
The engine side is ember/engine/async_engine.py (one background step loop, a queue per request).
"""
