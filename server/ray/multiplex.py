"""A replica's models under Ray Serve's model multiplexing.

With several models (`--model A --model B ...`, `--models-dir`), each replica's registry
(gptserve.server.models) acquires a request's model through `serve.multiplexed`: Ray's LRU of at
most `max_models_per_replica` models per replica decides which models the replica holds, and
Ray's router sends a model's requests (their multiplexed model id, set in the proxy by
gptserve.server.ray.model_routing) to the replicas that hold it. When Ray evicts a model to make
room it calls the held object's `__del__`, which unloads the model from the registry once its
requests have finished. The registry's own limits step aside: under Ray a model stays loaded
until Ray evicts it (no `--keep-alive`), and `--max-loaded-models` is the replica's maximum.
A replica of one model holds it in Ray's LRU too (from its start): requests that name it are
routed to any replica at once, rather than after a round of Ray's fallback.

`ReplicaModels.install` puts the multiplexed acquire in front of the registry's; `ModelRequests`
(ASGI middleware) keeps per-request notes and names the base model of a request that named an
adapter in the `x-gptserve-base-model` response header (the proxy routes by it afterwards).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gptserve.server.models.registry import ModelRegistry
from gptserve.server.ray.model_routing import BASE_MODEL_HEADER
from gptserve.server.runtime import ServerState
from ray import serve
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)
_IDLE_POLL_SECONDS = 0.05


@dataclass
class _RequestNotes:
    base: str | None = None  # the base model of the adapter the request named
    held: set[str] = field(default_factory=set)  # models Ray's LRU has given this request


_NOTES: contextvars.ContextVar[_RequestNotes | None] = contextvars.ContextVar(
    "ray_request_notes", default=None
)


class ReplicaModels:
    """A replica's registry with Ray's multiplexed LRU in front of its loads (see the module's
    docstring). `on_loaded(name, state)` runs after each load, before any request uses it."""

    def __init__(
        self,
        registry: ModelRegistry,
        max_models: int,
        on_loaded: Callable[[str, ServerState], Awaitable[None]] | None = None,
    ) -> None:
        self.registry = registry
        self.max_models = max_models
        self.on_loaded = on_loaded
        self.direct_acquire = registry.acquire  # the registry's own, which loads on demand

        async def load(name: str) -> HeldModel:  # Ray calls it on a miss, under its LRU's lock
            state = await self.direct_acquire(name)
            if self.on_loaded is not None:
                await self.on_loaded(name, state)
            return HeldModel(self, name, asyncio.get_running_loop())

        self.load = serve.multiplexed(max_num_models_per_replica=max_models)(load)

    def install(self) -> ReplicaModels:
        """Route the registry's acquires (every handler's) through Ray's LRU; returns self."""
        self.registry.acquire = self.acquire  # type: ignore[method-assign]
        return self

    async def acquire(self, name: str | None) -> ServerState:
        """The registry's acquire, with the base model held in Ray's LRU first (which may evict
        another); 404 for an unknown name before Ray hears of it."""
        base = base_name(self.registry.state(name))
        notes = _NOTES.get()
        if notes is None or base not in notes.held:  # a request acquires its model once in Ray
            await self.load(base)
            if notes is not None:
                notes.held.add(base)
        if notes is not None and name and name != base:
            notes.base = base
        return await self.direct_acquire(name)

    async def hold(self, name: str) -> None:
        """Register a model loaded outside a request (--preload, a single model) with Ray's
        LRU."""
        await self.load(name)

    async def evict(self, name: str) -> None:
        """Unload `name` once it has no request in flight (at most --request-timeout)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.registry.settings.request_timeout
        while not _idle(self.registry, name) and loop.time() < deadline:
            await asyncio.sleep(_IDLE_POLL_SECONDS)
        log.info("Ray's LRU evicts %s from this replica", name)
        await self.registry.unload(name)


def _idle(registry: ModelRegistry, name: str) -> bool:
    """Whether no request holds or runs on the model `name` (the registry's own test, which
    its LRU applies before an unload)."""
    return registry._entry(name).idle  # noqa: SLF001 - the registry's idle test, not public yet


def base_name(state: ServerState) -> str:
    """The name of the model a state serves (a server of several names each state's settings)."""
    if state.settings.served_model_name:
        return state.settings.served_model_name
    return state.loaded.name if state.loaded is not None else state.settings.model_path.name


class HeldModel:
    """What Ray's LRU holds for one loaded model: evicting it (Ray calls `__del__`, in a worker
    thread, and waits) unloads the model. A later call (the garbage collector's) does nothing."""

    def __init__(self, models: ReplicaModels, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.models = models
        self.name = name
        self.loop = loop
        self.evicted = False

    def __del__(self) -> None:
        if self.evicted:
            return
        self.evicted = True
        try:
            asyncio.get_running_loop()
            return  # the event loop's own thread (a collection): it must not block here
        except RuntimeError:
            pass
        try:
            future = asyncio.run_coroutine_threadsafe(self.models.evict(self.name), self.loop)
            future.result()
        except Exception:  # a closed loop at shutdown; Ray goes on with its next load
            log.warning("unloading %s failed", self.name, exc_info=True)


class ModelRequests:
    """ASGI middleware: per-request notes for ReplicaModels, and the `x-gptserve-base-model`
    header on the answer to a request that named an adapter."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        notes = _RequestNotes()
        token = _NOTES.set(notes)

        async def noted_send(message: Message) -> None:
            if message["type"] == "http.response.start" and notes.base is not None:
                header = (BASE_MODEL_HEADER.encode(), notes.base.encode())
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        try:
            await self.app(scope, receive, noted_send)
        finally:
            _NOTES.reset(token)
