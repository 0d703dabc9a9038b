"""Errors on the Messages API's paths in Anthropic's shape:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, same status.

Every other path keeps OpenAI's shape (server.errors). `AnthropicErrorShape` wraps the whole app
(server.error_shapes), so the gate's and FastAPI's own error answers are reshaped too.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from gptserve.server.error_shapes import ErrorShape

PREFIX = "/v1/messages"
# HTTP status -> Anthropic's error type (docs.anthropic.com/en/api/errors)
TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
}
OVERLOADED = ("loading",)  # a 503 that a retry soon gets past (the model is still loading)


def error_type(status: int, code: str | None = None) -> str:
    if status >= 500:
        return "overloaded_error" if code in OVERLOADED else "api_error"
    return TYPES.get(status, "invalid_request_error")


def anthropic_error(status: int, message: str, code: str | None = None) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status, code), "message": message}}


def is_messages_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


# ASGI middleware: error answers under /v1/messages in Anthropic's shape (server.error_shapes)
AnthropicErrorShape = partial(ErrorShape, matches=is_messages_path, shape=anthropic_error)
