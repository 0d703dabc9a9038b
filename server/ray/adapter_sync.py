"""A replica's side of the adapter record (gptserve.server.ray.adapter_book): LoRA adapter loads
and unloads reach every replica that holds the base model.

`AdapterSync.run` long polls the record and applies each change to the replica's models: on a
loaded base the adapter is read and put in a LoRA slot (or taken out); on a base that is not
loaded it is only named, and comes with the base when that loads (the runtime loads a model's
named adapters with it; `apply_base` runs again after each load). `AdapterFanOut` (ASGI
middleware) watches the admin endpoints: once the replica that took the request has loaded or
unloaded the adapter itself (a 200 from server.lora_api, which checked the key, the path and the
adapter), it records the change and answers once every live replica has applied it. A load that
fails on another replica is undone everywhere and answers 503 `lora_load_incomplete`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from gptserve.engine.adapters import NAME_TAKEN, NOT_FOUND, AdapterError
from gptserve.server.errors import APIError
from gptserve.server.lora_api import read_rooted_adapter
from gptserve.server.models.registry import ModelRegistry
from gptserve.server.ray.adapter_book import Adapters
from gptserve.server.ray.multiplex import base_name
from gptserve.server.runtime import ServerState
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)
POLL_SECONDS = 5.0  # a long poll's wait when nothing changes
APPLY_TIMEOUT = 60.0  # how long an admin's request waits for the other replicas
LOAD_PATH, UNLOAD_PATH = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


class AdapterSync:
    """Applies the record's adapters to one replica's models (see the module's docstring).
    `book`: a handle of the AdapterBook deployment."""

    def __init__(self, book: Any, registry: ModelRegistry, replica: str) -> None:
        self.book = book
        self.registry = registry
        self.replica = replica
        self.version = 0  # the record's version applied here
        self.adapters: Adapters = {}
        # (base, adapter) -> (its source, id of the engine it went into; None: named only)
        self.applied: dict[tuple[str, str], tuple[str | None, int | None]] = {}
        self.lock = asyncio.Lock()

    async def run(self) -> None:
        """Long poll the record and apply it, until cancelled."""
        errors: dict[str, str] = {}
        while True:
            try:
                version, adapters = await self.book.sync.remote(
                    self.replica, self.version, errors, POLL_SECONDS
                )
                errors = {}
                if version != self.version:
                    self.adapters = adapters
                    errors = await self.apply_all()
                    self.version = version
            except asyncio.CancelledError:
                raise
            except Exception:  # the record's replica restarting, say: ask again shortly
                log.warning("syncing LoRA adapters failed; retrying", exc_info=True)
                await asyncio.sleep(1.0)

    async def apply_all(self) -> dict[str, str]:
        """Apply the record to every model; returns the adapters that failed, with why."""
        errors: dict[str, str] = {}
        for base in list(self.adapters):
            errors.update(await self.apply_base(base))
        return errors

    async def apply_base(self, base: str, state: ServerState | None = None) -> dict[str, str]:
        """Apply the record's adapters of `base` (after a load of it, too)."""
        try:
            state = state or self.registry.state(base)
        except APIError:  # a base this replica does not serve
            return {}
        errors: dict[str, str] = {}
        async with self.lock:
            for name, source in list(self.adapters.get(base, {}).items()):
                try:
                    await self._apply(base, state, name, source)
                except (AdapterError, APIError) as exc:
                    errors[name] = exc.message
                except Exception as exc:  # a dead engine, a timeout: named to the admin
                    errors[name] = str(exc) or repr(exc)
                if name in errors:
                    log.warning("LoRA adapter %s on %s: %s", name, base, errors[name])
        return errors

    async def on_loaded(self, base: str, state: ServerState) -> None:
        """ReplicaModels' hook: a model that has just loaded gets the record's adapters."""
        await self.apply_base(base, state)

    async def _apply(self, base: str, state: ServerState, name: str, source: str | None) -> None:
        engine = state.async_engine
        engine_id = None if engine is None else id(engine)
        if self.applied.get((base, name)) == (source, engine_id):
            return
        current = state.lora_names.get(name)
        if engine is not None and current is not None and current != source:
            state.lora_names.pop(name, None)  # gone, or to be read from elsewhere
            try:
                await engine.run_on_engine(lambda e: e.adapters.unload(name))
            except AdapterError as exc:
                if exc.code != NOT_FOUND:
                    raise
        if source is None:
            state.lora_names.pop(name, None)
        elif engine is None or state.loaded is None:  # named: it loads with its base
            state.lora_names[name] = source
        else:  # into this engine (it may have it already: loaded here, or with its base)
            roots, config = state.settings.lora_roots, state.loaded.model.config
            adapter = await asyncio.to_thread(read_rooted_adapter, source, roots, config, name)
            try:
                await engine.run_on_engine(lambda e: e.adapters.load(name, adapter))
            except AdapterError as exc:
                if exc.code != NAME_TAKEN:
                    raise
            state.lora_names[name] = source
        self.applied[(base, name)] = (source, engine_id)


class AdapterFanOut:
    """ASGI middleware: an admin's adapter load or unload that succeeded here is recorded for
    every replica, and answered once they have applied it (see the module's docstring)."""

    def __init__(self, app: ASGIApp, sync: AdapterSync) -> None:
        self.app = app
        self.sync = sync
        self.book = sync.book

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope["method"] != "POST" or path not in (
            LOAD_PATH, UNLOAD_PATH,
        ):  # fmt: skip
            await self.app(scope, receive, send)
            return
        body: list[bytes] = []
        held: list[Message] = []

        async def teed_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def held_send(message: Message) -> None:
            held.append(message)

        await self.app(scope, teed_receive, held_send)
        if held and held[0]["type"] == "http.response.start" and held[0]["status"] == 200:
            try:
                change = self._change(path, json.loads(b"".join(body)))
            except (ValueError, KeyError, TypeError, APIError):
                change = None
            if change is not None:
                try:
                    error = await self._fan_out(*change)
                except Exception as exc:  # the record's deployment unreachable, say
                    log.exception("recording LoRA adapter %s failed", change[1])
                    error = APIError(
                        503, f"the LoRA adapter {change[1]!r} changed on this replica only: the "
                        f"record the replicas share could not be reached ({type(exc).__name__}); "
                        "retry", code="lora_record_unavailable",
                    )  # fmt: skip
                if error is not None:
                    await error.response()(scope, receive, send)
                    return
        for message in held:
            await send(message)

    async def _fan_out(self, base: str, name: str, source: str | None) -> APIError | None:
        """Record the change and wait for the replicas; an error to answer instead, if any."""
        version = await self.book.record.remote(base, name, source)
        failed, behind = await self.book.wait_applied.remote(version, name, APPLY_TIMEOUT)
        if behind:
            log.warning("LoRA adapter %s: replicas %s have not applied it yet (they will when "
                        "they next reach the record)", name, ", ".join(behind))  # fmt: skip
        if not failed or source is None:
            if failed:
                log.warning("unloading LoRA adapter %s: %s", name, "; ".join(failed))
            return None
        undo = await self.book.record.remote(base, name, None)  # out everywhere, here too
        await self.book.wait_applied.remote(undo, name, APPLY_TIMEOUT)
        return APIError(
            503, f"the LoRA adapter {name!r} loaded here but not on every replica that serves "
            f"{base!r}, so it was unloaded again: {'; '.join(failed)}",
            code="lora_load_incomplete",
        )  # fmt: skip

    def _change(self, path: str, body: dict) -> tuple[str, str, str | None]:
        """(base, adapter, source or None) of a successful load or unload request's body."""
        name, registry = body["lora_name"], self.sync.registry
        if path == LOAD_PATH:
            return base_name(registry.state(body.get("base_model"))), name, body["lora_path"]
        for base, adapters in self.sync.adapters.items():  # one recorded at run time
            if adapters.get(name) is not None:
                return base, name, None
        return base_name(registry.state(None)), name, None  # --lora's: the default model's
