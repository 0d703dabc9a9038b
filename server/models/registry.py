"""The models one server serves, each a ServerState of its own, loaded on demand and unloaded
when idle or when room is needed (Ollama's scheduler, in small: a model with requests in flight
is never unloaded; the least recently used idle one goes first).

A server of one model (a single --model) has one state, loaded at start as always: `acquire`
returns it as it is (its handlers answer 503 "loading" until it serves) and nothing unloads it.
A server of several (`Settings.serves_many`) loads a model on its first request, which waits for
the load while the other models keep serving; `--preload` loads some at start.

A request holds a lease on its model from `acquire` until its response is sent (the
`ModelLeases` middleware releases it), so that no unload can take the model from under a
request that has not yet reached its engine. Code outside a request (Ray replicas) uses
`lease(name)`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from gptserve.server.errors import APIError
from gptserve.server.metrics import Metrics
from gptserve.server.models.memory import rss_bytes
from gptserve.server.models.specs import ModelSpec, check_preload, model_settings, model_specs
from gptserve.server.runtime import LoadedModel, ServerState, load_model
from gptserve.server.settings import Settings
from starlette.types import ASGIApp, Receive, Scope, Send

log = logging.getLogger(__name__)
_GIB = 1 << 30
_POLL_SECONDS = 0.05  # how often a load that waits for room looks again
# the entries the current request holds a lease on (set by ModelLeases around each request)
_LEASES: contextvars.ContextVar[list[_Entry] | None] = contextvars.ContextVar(
    "model_leases", default=None
)


@dataclass
class _Entry:
    spec: ModelSpec
    state: ServerState
    last_used: float = 0.0  # time.monotonic() of its last acquire or release
    leases: int = 0  # requests between acquire and their response's end
    keep_alive: float | None = None  # the last request's keep_alive (Ollama's), else None
    task: asyncio.Task | None = None  # its load or unload, while one runs
    unloading: bool = False
    estimate: int = 0  # resident bytes: measured once loaded, else from its files

    @property
    def loaded(self) -> bool:
        return self.state.async_engine is not None

    @property
    def idle(self) -> bool:
        return self.leases == 0 and not self.state.busy


class ModelRegistry:
    """Every model of one app by name; see the module's docstring."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        loader: Callable[[Settings], LoadedModel] = load_model,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.many = settings.serves_many
        self._entries: dict[str, _Entry] = {}
        self._room = asyncio.Lock()  # one load at a time decides what to unload
        self._reaper: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        if not self.many:  # one model: today's server (its name is known once it loads)
            state = ServerState(settings, metrics, loader)
            self._entries[""] = _Entry(ModelSpec("", settings.model or ""), state)
            return
        for i, spec in enumerate(model_specs(settings)):
            state = ServerState(
                model_settings(settings, spec, default=i == 0), metrics.for_model(spec.name), loader
            )
            state.load_error = spec.error
            self._entries[spec.name] = _Entry(spec, state, estimate=_file_bytes(spec))
        check_preload(settings, list(self._entries))

    # ---- names --------------------------------------------------------------------------

    def names(self) -> list[str]:
        """The served models' names, the default first (adapters not included)."""
        if not self.many:
            return [self._single_name()]
        return list(self._entries)

    def default_name(self) -> str:
        """The default model (the first): the one a request without a model gets."""
        return self.names()[0]

    def specs(self) -> list[ModelSpec]:
        """Every model's spec (with its error when it cannot be served)."""
        return [e.spec for e in self._entries.values()]

    def state(self, name: str | None) -> ServerState:
        """The state of the model `name` names (a model, one of its adapters or fine-tuned
        models, an Ollama `NAME:latest`; None: the default), loaded or not; nothing loads.
        404 model_not_found, listing the names, for any other name. A server of one model
        returns its one state for any name (its validator answers an unknown name)."""
        return self._entry(name).state

    def loaded(self) -> list[tuple[str, ServerState]]:
        """The loaded models, by name."""
        return [(self._name(e), e.state) for e in self._entries.values() if e.loaded]

    def is_loading(self, name: str) -> bool:
        entry = self._entry(name)
        return entry.task is not None and not entry.unloading

    def expires_at(self, name: str) -> float | None:
        """When (time.time()) the loaded model `name` unloads if it stays idle; None: never."""
        entry = self._entry(name)
        keep = self._keep_alive(entry)
        if not self.many or keep < 0:
            return None
        if not entry.idle:
            return time.time() + keep
        return time.time() + max(0.0, entry.last_used + keep - time.monotonic())

    def _single_name(self) -> str:
        state = self._entries[""].state
        if state.loaded is not None:
            return state.loaded.name
        return (
            self.settings.served_model_name
            or self.settings.model_name
            or self.settings.model_path.name
        )

    def _name(self, entry: _Entry) -> str:
        return entry.spec.name if self.many else self._single_name()

    def _entry(self, name: str | None) -> _Entry:
        if not self.many:
            return self._entries[""]
        if not name:
            return next(iter(self._entries.values()))
        found = self._entries.get(name) or self._entries.get(name.removesuffix(":latest"))
        if found is not None:
            return found
        for entry in self._entries.values():  # an adapter or a fine-tuned model: its base's
            if name in entry.state.lora_names:
                return entry
        names = ", ".join(self._entries)
        raise APIError(
            404, f"the model {name!r} does not exist; this server serves: {names}",
            param="model", code="model_not_found",
        )  # fmt: skip

    # ---- acquire and release --------------------------------------------------------------

    async def acquire(self, name: str | None) -> ServerState:
        """The state of the model `name` names (see `state`), loaded and marked used. A model
        that is not loaded loads now (in a thread; the caller waits, other models serve); one
        being unloaded is waited for and loaded again. 503 naming the model when its load
        fails or no room can be made for it. Inside a request (ModelLeases), the request holds
        a lease on the model until its response ends: no unload takes it meanwhile."""
        entry = self._entry(name)
        if not self.many:
            self._take(entry)
            return entry.state
        while True:
            task = entry.task
            if task is not None:  # a load (its error, if it failed) or an unload (then reload)
                failure = await asyncio.shield(task)
                if failure is not None:
                    raise failure
                continue
            if entry.loaded:
                self._take(entry)
                return entry.state
            if entry.spec.error is not None:
                raise self._load_failed(entry, entry.spec.error)
            entry.task = asyncio.create_task(self._load(entry))

    @asynccontextmanager
    async def lease(self, name: str | None) -> AsyncIterator[ServerState]:
        """`acquire`, holding the model (no unload) until the block ends."""
        token = _LEASES.set([])
        try:
            state = await self.acquire(name)
            yield state
        finally:
            self.release(_LEASES.get() or [])
            _LEASES.reset(token)

    def set_keep_alive(self, name: str | None, seconds: float | None) -> None:
        """A request's keep_alive (Ollama's): the model stays loaded `seconds` after it is idle
        again (0: unload once the answer is sent; negative: never; None: the server's)."""
        if self.many:
            entry = self._entry(name)
            entry.keep_alive = None if seconds is None else (-1.0 if seconds < 0 else seconds)

    def _take(self, entry: _Entry) -> None:
        entry.last_used = time.monotonic()
        leases = _LEASES.get()
        if leases is not None:
            entry.leases += 1
            leases.append(entry)

    def release(self, entries: list[_Entry]) -> None:
        """The end of the request that held these leases (ModelLeases calls it)."""
        for entry in entries:
            entry.leases -= 1
            entry.last_used = time.monotonic()
            if self.many and self._keep_alive(entry) == 0 and entry.leases == 0:
                self._spawn(self._unload_when_idle(entry))

    # ---- load and unload ------------------------------------------------------------------

    async def _load(self, entry: _Entry) -> APIError | None:
        """Load the model (its task): None once it serves, else the error its waiters get."""
        name = entry.spec.name
        try:
            async with self._room:
                await self._make_room(entry)
                entry.state.load_error = None
                before = rss_bytes()
                started = time.perf_counter()
                thread = entry.state.start_loading()
            await asyncio.to_thread(thread.join)
            if entry.state.load_error is not None or entry.state.async_engine is None:
                return self._load_failed(entry, entry.state.load_error or "it did not start")
            entry.estimate = entry.state.resident_bytes() or entry.estimate
            entry.last_used = time.monotonic()
            log.info(
                "loaded %s in %.1f s (resident memory %s -> %s MB)", name,
                time.perf_counter() - started, _mb(before), _mb(rss_bytes()),
            )  # fmt: skip
            return None
        except APIError as exc:
            return exc
        finally:
            entry.task = None

    def _load_failed(self, entry: _Entry, reason: str) -> APIError:
        if self.settings.auth_keys:  # the reason may name paths: it stays in the log
            reason = "the server log has the reason"
        return APIError(
            503, f"the model {entry.spec.name!r} failed to load: {reason}",
            code="model_load_failed",
        )  # fmt: skip

    async def _make_room(self, entry: _Entry) -> None:
        """Unload least recently used idle models until `entry` fits --max-loaded-models and
        --max-loaded-gb; wait (at most --request-timeout) while the others are busy."""
        models, budget = self.settings.max_loaded_models, self.settings.max_loaded_gb
        budget_bytes = None if budget is None else int(budget * _GIB)
        if budget_bytes is not None and entry.estimate > budget_bytes:
            raise APIError(
                503, f"the model {entry.spec.name!r} needs about {entry.estimate / _GIB:.2f} GiB, "
                f"more than --max-loaded-gb {budget:g}", code="model_too_large",
            )  # fmt: skip
        deadline = time.monotonic() + self.settings.request_timeout
        while True:
            others = [e for e in self._entries.values() if e is not entry and (e.loaded or e.task)]
            fits = models is None or len(others) < models
            if budget_bytes is not None:
                fits = fits and sum(e.estimate for e in others) + entry.estimate <= budget_bytes
            if fits:
                return
            idle = [e for e in others if e.loaded and e.task is None and e.idle]
            if idle:
                await self._unload_entry(min(idle, key=lambda e: e.last_used))
                continue
            if time.monotonic() > deadline:
                raise APIError(
                    503, f"no room to load the model {entry.spec.name!r}: every loaded model "
                    "has requests in flight (--max-loaded-models, --max-loaded-gb)",
                    code="no_room", headers={"Retry-After": "1"},
                )  # fmt: skip
            await asyncio.sleep(_POLL_SECONDS)

    async def unload(self, name: str) -> None:
        """Unload the model `name` now (waiting for a load in progress first); a model that is
        not loaded stays so. Requests in flight on it fail: callers unload idle models."""
        entry = self._entry(name)
        if not self.many:
            return
        while entry.task is not None:
            if entry.unloading:
                await asyncio.shield(entry.task)
                return
            await asyncio.shield(entry.task)
        if entry.loaded:
            await self._unload_entry(entry)

    async def _unload_entry(self, entry: _Entry) -> None:
        entry.unloading = True
        entry.task = asyncio.create_task(self._unload(entry))
        await asyncio.shield(entry.task)

    async def _unload(self, entry: _Entry) -> None:
        try:
            before = rss_bytes()
            await asyncio.to_thread(entry.state.unload)
            entry.keep_alive = None
            log.info(
                "unloaded %s (resident memory %s -> %s MB)", entry.spec.name, _mb(before),
                _mb(rss_bytes()),
            )  # fmt: skip
        finally:
            entry.task, entry.unloading = None, False

    async def _unload_when_idle(self, entry: _Entry) -> None:
        """keep_alive 0: unload once the model is idle (its last sequences may still finish)."""
        deadline = time.monotonic() + self.settings.request_timeout
        while entry.loaded and not entry.idle and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_SECONDS)
        if entry.loaded and entry.idle and entry.task is None and self._keep_alive(entry) == 0:
            await self._unload_entry(entry)

    def _keep_alive(self, entry: _Entry) -> float:
        return self.settings.keep_alive if entry.keep_alive is None else entry.keep_alive

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """At startup (in the event loop): load a single model, or --preload's models, and
        start the keep-alive reaper."""
        if not self.many:
            self._entries[""].state.start_loading()
            return
        for name in self.settings.preload:
            entry = self._entry(name)
            if entry.task is None and not entry.loaded and entry.spec.error is None:
                entry.task = asyncio.create_task(self._load(entry))
                self._background.add(entry.task)
                entry.task.add_done_callback(self._background.discard)
        self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        """Unload each model idle for longer than its keep-alive."""
        while True:
            await asyncio.sleep(_POLL_SECONDS * 5)
            now = time.monotonic()
            for entry in list(self._entries.values()):
                keep = self._keep_alive(entry)
                if keep < 0 or not entry.loaded or entry.task is not None or not entry.idle:
                    continue
                if now - entry.last_used >= keep:
                    try:
                        await self._unload_entry(entry)
                    except Exception:  # noqa: BLE001 - the reaper goes on with the others
                        log.exception("unloading %s failed", entry.spec.name)

    def _spawn(self, coro) -> None:  # noqa: ANN001
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def stop(self) -> None:
        """At shutdown (blocking): stop every engine."""
        if self._reaper is not None:
            self._reaper.cancel()
        for task in list(self._background):
            task.cancel()
        for entry in self._entries.values():
            entry.state.stop()

    def running(self) -> bool:
        """Whether the registry works: its reaper runs (a server of several)."""
        return not self.many or (self._reaper is not None and not self._reaper.done())


class ModelLeases:
    """ASGI middleware: the models a request acquires stay leased until its response ends."""

    def __init__(self, app: ASGIApp, registry: ModelRegistry) -> None:
        self.app = app
        self.registry = registry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        leases: list[_Entry] = []
        token = _LEASES.set(leases)
        try:
            await self.app(scope, receive, send)
        finally:
            _LEASES.reset(token)
            self.registry.release(leases)


def _file_bytes(spec: ModelSpec) -> int:
    """A model's size on disk: the estimate of its resident bytes before it first loads."""
    path = Path(spec.source)
    try:
        if path.is_file():
            return path.stat().st_size
        if path.is_dir():
            return sum(f.stat().st_size for f in path.iterdir() if f.suffix in _WEIGHT_SUFFIXES)
    except OSError:
        pass
    return 0


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


def _mb(size: int | None) -> str:
    return "?" if size is None else f"{size / 1e6:.0f}"
