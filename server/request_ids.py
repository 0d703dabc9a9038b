"""X-Request-Id: one id per HTTP request, in its response's headers and in every log line about it.

The id is the request's own `X-Request-Id` header when that is a sane token (at most 128 of
[A-Za-z0-9._:-], as a proxy or a client's tracing would send), else a fresh uuid4 hex. A pure
ASGI middleware, wrapped around the whole app (outside Starlette's error middleware, so a 500
carries it too, as do the 401/413/429 answers of the admission gate and every stream), sets it in
a ContextVar for the request's task and adds it to the response's headers; `RequestIdFilter`,
installed on the log handlers by `server.logging_setup`, writes it into each record as
`request_id`.

The engine thread does not run in a request's context: its per-request log lines name the
engine's request id (`extra={"engine_request_id": ...}`), which `bind_engine_request`
registered under the HTTP request's id while the request runs, and the filter maps it back.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from contextvars import ContextVar

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = "x-request-id"
_HEADER_BYTES = HEADER.encode()
MAX_LENGTH = 128
_VALID = re.compile(rb"[A-Za-z0-9._:-]{1,%d}" % MAX_LENGTH)
# the request's arrival in its scope (time.perf_counter()): where its span starts
ARRIVAL_KEY = "gptserve.arrival"

current_request_id: ContextVar[str | None] = ContextVar("gptserve_request_id", default=None)


def request_id_from(header: bytes | None) -> str:
    """The request's id: its header when that is a bounded token, else a fresh uuid4 hex."""
    if header is not None and _VALID.fullmatch(header):
        return header.decode("ascii")
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """ASGI middleware: the request's id in the ContextVar and in its response's headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL_KEY] = time.perf_counter()
        header = None
        for name, value in scope["headers"]:
            if name.lower() == _HEADER_BYTES:
                header = value
                break
        request_id = request_id_from(header)
        header_pair = (_HEADER_BYTES, request_id.encode("ascii"))

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [
                    (k, v) for k, v in message.get("headers", []) if k.lower() != _HEADER_BYTES
                ]
                message = {**message, "headers": [*headers, header_pair]}
            await send(message)

        token = current_request_id.set(request_id)
        await self.app(scope, receive, send_with_id)
        # left set when the app raised: the server's "Exception in ASGI application" line, logged
        # in this task right after, then carries the id (each request runs in a task of its own)
        current_request_id.reset(token)


def install(app: Starlette) -> None:
    """Wrap `app`'s whole middleware stack (a Starlette app's) in RequestIdMiddleware, so that
    even the answers Starlette's outermost error middleware makes carry the id."""
    build = app.build_middleware_stack

    def build_with_request_ids() -> ASGIApp:
        return RequestIdMiddleware(build())

    app.build_middleware_stack = build_with_request_ids  # type: ignore[method-assign]


# ---- the engine thread's lines --------------------------------------------------------------

_engine_requests: dict[str, str] = {}  # engine request id (without its "-prompt" suffix) -> id
_engine_lock = threading.Lock()


def bind_engine_request(engine_id: str) -> None:
    """Until `unbind_engine_request`, log lines about engine request `engine_id` or
    `engine_id-N` (one per prompt) carry the current request's id."""
    request_id = current_request_id.get()
    if request_id is not None:
        with _engine_lock:
            _engine_requests[engine_id] = request_id


def unbind_engine_request(engine_id: str) -> None:
    with _engine_lock:
        _engine_requests.pop(engine_id, None)


def _engine_request_id(engine_id: object) -> str | None:
    if not isinstance(engine_id, str):
        return None
    found = _engine_requests.get(engine_id)
    if found is None:
        found = _engine_requests.get(engine_id.rpartition("-")[0])
    return found


class RequestIdFilter(logging.Filter):
    """Adds `request_id` to every record: the one it was given (`extra`), the current request's,
    that of the engine request it names (`engine_request_id`), or None."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            request_id = current_request_id.get()
            if request_id is None:
                request_id = _engine_request_id(getattr(record, "engine_request_id", None))
            record.request_id = request_id
        return True
