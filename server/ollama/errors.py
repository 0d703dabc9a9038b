"""Errors on Ollama's paths (/api/...) in Ollama's shape: `{"error": "message"}`, same status
(400 a bad request, 401 a missing key, 404 an unknown model or route, 500 and 503 the server's).

`OllamaErrorShape` wraps the whole app, as server.messages.errors' middleware does, so the gate's
401/413/429/408 and FastAPI's own 404/405 are reshaped too: any JSON error answer under /api/
becomes Ollama's, its `param` put before the message when the message does not name it.
"""

from __future__ import annotations

import json
from typing import Any

from gptserve.server.errors import ErrorResponse
from gptserve.server.messages.errors import _is_json
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/api/"


def ollama_error(message: str) -> dict[str, Any]:
    return {"error": message}


def is_ollama_path(path: str) -> bool:
    return path.startswith(PREFIX)


def error_message(message: str, param: str | None) -> str:
    if param and param not in message:
        return f"{param}: {message}"
    return message


def reshape(body: bytes) -> bytes:
    """An OpenAI-shaped error body as Ollama's (another body is left as it is)."""
    try:
        data = json.loads(body)
    except ValueError:
        return body
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        return body
    param = err.get("param")
    message = error_message(str(err.get("message") or "error"), param if isinstance(param, str) else None)  # fmt: skip
    return ErrorResponse(ollama_error(message)).body


class OllamaErrorShape:
    """ASGI middleware: error answers under /api/ in Ollama's shape."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_ollama_path(scope["path"]):
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
                body = reshape(b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers", [])
                           if k.lower() != b"content-length"]  # fmt: skip
                headers.append((b"content-length", str(len(body)).encode()))
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
            await send(message)

        await self.app(scope, receive, reshaping_send)
