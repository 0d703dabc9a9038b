"""Error answers of another API's paths in that API's shape (Anthropic's under /v1/messages,
Ollama's under /api/), whoever answered them: a route, the gate in front of the routes (401,
413, 429, 408) or FastAPI itself (404, 405).

`ErrorShape` wraps the whole app. Under its paths it holds back a JSON answer of status 400 or
more until its body is whole and hands the OpenAI-shaped error in it (server.errors) to the
API's `shape(status, message, code)`; the error's `param` goes before the message when the
message does not already name it (neither API has a param field). Any other answer passes as
it is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gptserve.server.errors import ErrorResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# (status, message, code) -> the API's error body
Shape = Callable[[int, str, str | None], dict[str, Any]]


def with_param(message: str, param: str | None) -> str:
    """The message, with the field it is about before it when it does not name it."""
    return f"{param}: {message}" if param and param not in message else message


def reshape(body: bytes, status: int, shape: Shape) -> bytes:
    """An OpenAI-shaped error body in `shape`'s form; any other body as it is."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or data.get("type") == "error":  # not OpenAI's, or Anthropic's
        return body
    param = err.get("param") if isinstance(err.get("param"), str) else None
    message = with_param(str(err.get("message") or "error"), param)
    return ErrorResponse(shape(status, message, err.get("code"))).body


def _is_json(start: Message) -> bool:
    for key, value in start.get("headers", []):
        if key.lower() == b"content-type":
            return value.startswith(b"application/json")
    return False


class ErrorShape:
    """ASGI middleware: error answers on the paths `matches` accepts, in `shape`'s form."""

    def __init__(self, app: ASGIApp, matches: Callable[[str], bool], shape: Shape) -> None:
        self.app, self.matches, self.shape = app, matches, shape

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.matches(scope["path"]):
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
                body = reshape(b"".join(chunks), start["status"], self.shape)
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() != b"content-length"]  # fmt: skip
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, reshaping_send)
