"""Routing by model in Ray Serve's HTTP proxy: a request goes to a replica that has its model.

`ModelRouting` runs inside the proxy (installed with `OpenAIErrors`, see
gptserve.server.ray.proxy_middleware). It reads a JSON request's `model` field and sets Ray's
`serve_multiplexed_model_id` header to it, so Ray routes the request to a replica that has that
model loaded (Ray Serve's model multiplexing; each replica registers the models it loads,
gptserve.server.ray.multiplex). A request that names a LoRA adapter is routed by the adapter's
base model once the proxy knows it: replicas name the base of an adapter they answered for in
the `x-gptserve-base-model` response header, and the proxy remembers the last `KNOWN_ADAPTERS`.

The body is read before the request goes on (at most `MAX_PARSED_BYTES`: a larger one, or one
that is not JSON, goes on unrouted, read and checked by the replica as always) and replayed.
A client's own `serve_multiplexed_model_id` header is kept.
"""

from __future__ import annotations

import json
from collections import OrderedDict

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MULTIPLEXED_HEADER = b"serve_multiplexed_model_id"  # Ray Serve's; hyphens work as well
BASE_MODEL_HEADER = "x-gptserve-base-model"  # a replica's answer: the adapter's base model
MAX_PARSED_BYTES = 1 << 20
KNOWN_ADAPTERS = 4096
_JSON = b"application/json"


class ModelRouting:
    """ASGI middleware: a JSON body's `model` becomes the request's multiplexed model id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.bases: OrderedDict[str, str] = OrderedDict()  # adapter -> its base model

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or _pinned(scope):
            await self.app(scope, receive, send)
            return
        if _content_type(scope) != _JSON:
            await self.app(scope, receive, send)
            return
        messages, complete = await _read_some(receive, MAX_PARSED_BYTES)
        body = b"".join(m.get("body", b"") for m in messages)
        model = request_model(body) if complete else None
        if model is not None:
            routed = self.bases.get(model, model)
            header = (MULTIPLEXED_HEADER, routed.encode())
            scope = {**scope, "headers": [*scope["headers"], header]}
            send = self._learning(model, send)
        await self.app(scope, _replay(messages, receive), send)

    def _learning(self, model: str, send: Send) -> Send:
        """`send`, noting the base model a replica names for `model` (an adapter)."""

        async def learning_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                base = dict(message.get("headers", [])).get(BASE_MODEL_HEADER.encode())
                if base:
                    self.bases[model] = base.decode("latin-1")
                    self.bases.move_to_end(model)
                    while len(self.bases) > KNOWN_ADAPTERS:
                        self.bases.popitem(last=False)
            await send(message)

        return learning_send


def request_model(body: bytes) -> str | None:
    """The `model` of a JSON object body, when it is a non-empty string; else None."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    model = parsed.get("model") if isinstance(parsed, dict) else None
    return model if isinstance(model, str) and model and model.isprintable() else None


def _pinned(scope: Scope) -> bool:
    """Whether the client named the multiplexed model id itself."""
    wanted = MULTIPLEXED_HEADER.decode()
    return any(k.decode("latin-1").lower().replace("-", "_") == wanted for k, _ in scope["headers"])


def _content_type(scope: Scope) -> bytes:
    value = dict(scope["headers"]).get(b"content-type", b"")
    return value.split(b";")[0].strip().lower()


async def _read_some(receive: Receive, limit: int) -> tuple[list[Message], bool]:
    """The request's messages until its body ends (complete: True) or passes `limit` bytes or
    the client leaves (False)."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, False
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return messages, True
        if size > limit:
            return messages, False


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that gives `messages` again, then goes on with `receive`."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
