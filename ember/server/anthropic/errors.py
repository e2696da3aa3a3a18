"""Errors in Anthropic's shape, for every answer under /v1/messages.

`{"type": "error", "error": {"type": ..., "message": ...}}` with the HTTP status ember gives the same
error on its OpenAI routes; the type is Anthropic's name for that status, which the anthropic SDK turns
into its exception classes (BadRequestError, AuthenticationError, ...). ember.server.api picks this shape
by the request's path (`speaks_anthropic`), so validation errors, a wrong key and unknown sub-routes come
back in it too. After a stream has begun the same body goes out in-band as an `event: error` (the SDK's
stream parser raises it as an APIStatusError).
"""

from __future__ import annotations

import json
import re

from fastapi.responses import JSONResponse

# the paths answered in this shape, whatever prefix (--root-path) is in front of them
_PATH = re.compile(r"/v1/messages(/|$)")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",  # ember's overload, warm-up and shutdown: a client retries later
    529: "overloaded_error",
}


def speaks_anthropic(path: str) -> bool:
    """Whether a request path is one of the Messages API's (its errors take Anthropic's shape)."""
    return _PATH.search(path) is not None


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_response(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(status, message), status_code=status)


def error_event(status: int, message: str) -> str:
    """The SSE event that reports a failure after a stream's headers went out."""
    return "event: error\ndata: " + json.dumps(error_body(status, message), separators=(",", ":")) + "\n\n"
