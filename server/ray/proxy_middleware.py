"""OpenAI-shaped errors from Ray Serve's HTTP proxy.

The replicas answer every error in OpenAI's shape themselves, but some answers come from the
proxy: its request timeout (408), back-pressure (429/503), no replica available (503), as plain
text, and a replica that dies mid-request leaves the proxy with no answer at all (uvicorn then
sends a plain-text 500, or cuts a stream short). `OpenAIErrors` runs inside the proxy and gives
those the API's shape: a JSON error, or, in a stream that had started, one `data: {"error": ...}`
event followed by `data: [DONE]`.

`ModelRouting` (gptserve.server.ray.model_routing) runs there too: it routes each request to a
replica that has its model.

Ray installs them from the environment of the processes it starts:
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=gptserve.server.ray.proxy_middleware:proxy_middlewares` (set it before
`ray start` or `serve run`; `gptserve ray` sets it for the Ray it starts).
"""

from __future__ import annotations

import json
import logging

from gptserve.server.errors import error_body
from gptserve.server.ray.model_routing import ModelRouting
from starlette.middleware import Middleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
PROXY_CALLBACK = "gptserve.server.ray.proxy_middleware:proxy_middlewares"

_JSON, _SSE = b"application/json", b"text/event-stream"
_CODES = {408: "timeout", 429: "too_many_requests", 503: "unavailable"}
_REPLICA_LOST = "the replica answering this request stopped; retry"


def proxy_middlewares() -> list[Middleware]:
    """Ray Serve's HTTP proxy callback: the middlewares the proxy puts in front of itself (its
    errors in OpenAI's shape; requests routed by their model, server.ray.model_routing)."""
    return [Middleware(OpenAIErrors), Middleware(ModelRouting)]


class OpenAIErrors:
    """ASGI middleware: plain-text error answers become OpenAI-shaped JSON; a request the proxy
    leaves unanswered gets a 503, and a stream it leaves unfinished gets an error event and
    `[DONE]`. JSON answers and complete streams pass through untouched."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # a plain-text error's start, sent once its body is here
        body: list[bytes] = []
        started = stream = ended = False

        async def shaped_send(message: Message) -> None:
            nonlocal held, started, stream, ended
            if message["type"] == "http.response.start":
                kind = _content_type(message)
                if message["status"] >= 400 and kind not in (_JSON, _SSE):
                    held = message
                    return
                started, stream = True, kind == _SSE
            elif message["type"] == "http.response.body":
                if held is not None:
                    body.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        start, held = held, None
                        await _send_error(send, start["status"], b"".join(body), start)
                        started = ended = True
                    return
                ended = not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, shaped_send)
        except Exception:  # the proxy lost the replica; answer in the API's shape below
            log.warning("the proxy failed a request", exc_info=True)
        if held is not None:  # a plain-text error that never sent its body
            await _send_error(send, held["status"], b"", held)
        elif not started:
            await _send_error(send, 503, _REPLICA_LOST.encode(), None)
        elif stream and not ended:
            err = error_body(_REPLICA_LOST, "server_error", None, "replica_lost")
            event = b"data: " + json.dumps(err).encode() + b"\n\ndata: [DONE]\n\n"
            await send({"type": "http.response.body", "body": event, "more_body": False})


def _content_type(message: Message) -> bytes:
    headers = dict(message.get("headers", []))
    return headers.get(b"content-type", b"").split(b";")[0].strip().lower()


async def _send_error(send: Send, status: int, text: bytes, start: Message | None) -> None:
    message = text.decode("utf-8", "replace").strip() or f"HTTP {status} from the proxy"
    kind = "server_error" if status >= 500 else "invalid_request_error"
    if status == 429:
        kind = "rate_limit_error"
    code = _CODES.get(status, "proxy_error") if start is not None else "replica_lost"
    payload = json.dumps(error_body(message, kind, None, code)).encode()
    kept = [
        (k, v)
        for k, v in (start or {}).get("headers", [])
        if k.lower() not in (b"content-type", b"content-length")
    ]
    if start is None:
        kept.append((b"retry-after", b"1"))
    headers = [*kept, (b"content-type", _JSON), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
