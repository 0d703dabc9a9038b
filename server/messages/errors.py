"""Errors on the Messages API's paths in Anthropic's shape:
`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, same status.

Every other path keeps OpenAI's shape (server.errors). `AnthropicErrorShape` wraps the whole app,
so it also reshapes what the gate in front of the routes answers (401 for a wrong key, 413, 429,
408) and what FastAPI itself answers (a 404 or 405): any JSON error answer under /v1/messages is
rewritten, its `param` (Anthropic's errors have none) put before the message when the message
does not already name it.
"""

from __future__ import annotations

import json
from typing import Any

from gptserve.server.errors import ErrorResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

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


def reshape(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body as Anthropic's (another body is left as it is)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or data.get("type") == "error":
        return body
    message = str(err.get("message") or "error")
    param = err.get("param")
    if isinstance(param, str) and param and param not in message:
        message = f"{param}: {message}"
    return ErrorResponse(anthropic_error(status, message, err.get("code"))).body


class AnthropicErrorShape:
    """ASGI middleware: error answers under /v1/messages in Anthropic's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        start: Message | None = None  # an error's start, held until its body is whole
        chunks: list[bytes] = []

        async def reshaping_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                if message["status"] >= 400 and _is_json(message):
                    start = message
                    return
            elif message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                body = reshape(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() != b"content-length"]  # fmt: skip
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, reshaping_send)


def _is_json(start: Message) -> bool:
    for key, value in start.get("headers", []):
        if key.lower() == b"content-type":
            return value.startswith(b"application/json")
    return False
