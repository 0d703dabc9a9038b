"""The Ray Serve deployment: one gptserve engine per replica, behind Ray Serve's HTTP proxy.

Each replica serves the app that `create_app` builds (the same routes, errors, API keys,
streaming and playground as `gptserve serve`) with its own engine thread, and names itself in
an `x-gptserve-replica` response header. A replica is healthy once its model serves: its first
health check waits for the load, and afterwards every check gives `/health`'s verdict (a failed
load or a dead engine is a 503), so Ray replaces a replica that stops serving even while its
process lives on.

With several models (`--model A --model B ...`, `--models-dir`) a replica loads the models its
requests name, at most `max_models_per_replica` at once, through Ray Serve's model multiplexing
(gptserve.server.ray.multiplex), and Ray routes each model's requests to the replicas that hold
it. With `--enable-lora-loading` the deployment has a second one, the adapter record
(gptserve.server.ray.adapter_book), through which an admin's adapter load or unload reaches
every replica (gptserve.server.ray.adapter_sync). Each replica's Prometheus registry is copied into Ray's metrics every few
seconds (`MetricsMirror`), tagged with the deployment, replica and application.

`gptserve.server.ray.cli` builds applications from this module (`serve run`, config files, its CLI).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

from fastapi import FastAPI
from gptserve.server.app import create_app
from gptserve.server.logging_setup import setup_logging
from gptserve.server.models.registry import ModelRegistry
from gptserve.server.ray.adapter_book import BOOK_DEPLOYMENT, AdapterBook
from gptserve.server.ray.adapter_sync import AdapterFanOut, AdapterSync
from gptserve.server.ray.multiplex import ModelRequests, ReplicaModels
from gptserve.server.runtime import ServerState
from gptserve.server.settings import (
    ADMIN_API_KEYS_ENV,
    API_KEYS_ENV,
    Settings,
    SettingsError,
)
from prometheus_client import CollectorRegistry
from ray import serve
from ray.serve import metrics as serve_metrics
from ray.serve.deployment import Application
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

DEPLOYMENT_NAME = "gptserve"
REPLICA_HEADER = "x-gptserve-replica"


@dataclass(frozen=True)
class ScaleOptions:
    """How many replicas, what each one reserves, when Ray adds or removes one, and how it
    tells a broken one.

    Without `num_replicas` the deployment autoscales between `min_replicas` and `max_replicas`
    on queue depth: Ray's ongoing requests per replica (those a replica is answering, running
    or waiting in its engine, plus those queued for it in the proxy) against
    `target_ongoing_requests`.

    A replica's first health check waits up to `load_timeout` for its checkpoint (Ray sets no
    limit of its own on a replica's start). After that Ray calls the check every
    `health_check_period_s`; one that raises, or takes longer than `health_check_timeout_s`, counts
    as failed, and three failures in a row get the replica replaced.
    """

    num_replicas: int | None = None  # a fixed count; None: autoscale
    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 16.0
    max_ongoing_requests: int = 64  # a replica's cap; more wait in the proxy
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0  # the window Ray averages the ongoing requests over
    num_cpus: float = 1.0  # per replica; Ray sets OMP_NUM_THREADS (torch's threads) from it
    num_gpus: float = 0.0  # per replica
    load_timeout: float = 600.0  # seconds a replica may take to load its checkpoint
    health_check_period_s: float = 10.0  # seconds between Ray's health checks of a replica
    health_check_timeout_s: float = 30.0  # a check that takes longer counts as failed
    metrics_interval: float = 5.0  # seconds between copies of the registry into Ray's metrics
    max_models_per_replica: int = 3  # with several models: those one replica holds at once

    def validate(self) -> ScaleOptions:
        """Raise SettingsError for the first value Ray cannot run with; returns self."""
        if self.num_replicas is not None and self.num_replicas < 1:
            raise SettingsError("num_replicas must be >= 1")
        if self.min_replicas < 0 or self.max_replicas < 1:
            raise SettingsError("min_replicas must be >= 0 and max_replicas >= 1")
        if self.min_replicas > self.max_replicas:
            raise SettingsError("min_replicas must not be above max_replicas")
        if self.max_models_per_replica < 1:
            raise SettingsError("max_models_per_replica must be >= 1")
        for name in ("target_ongoing_requests", "max_ongoing_requests", "look_back_period_s",
                     "load_timeout", "health_check_period_s", "health_check_timeout_s",
                     "metrics_interval"):  # fmt: skip
            if not getattr(self, name) > 0:
                raise SettingsError(f"{name} must be > 0")
        for name in ("upscale_delay_s", "downscale_delay_s", "num_cpus", "num_gpus"):
            if getattr(self, name) < 0:
                raise SettingsError(f"{name} must be >= 0")
        return self

    def deployment_options(self, settings: Settings) -> dict[str, Any]:
        """Keyword arguments of `serve.deployment` for these options and server settings."""
        options: dict[str, Any] = {
            "name": DEPLOYMENT_NAME,
            "max_ongoing_requests": self.max_ongoing_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "graceful_shutdown_timeout_s": settings.shutdown_grace,
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
        }
        if self.num_replicas is not None:
            options["num_replicas"] = self.num_replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas,
                "initial_replicas": max(self.min_replicas, 1),
                "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests,
                "upscale_delay_s": self.upscale_delay_s,
                "downscale_delay_s": self.downscale_delay_s,
                "look_back_period_s": self.look_back_period_s,
            }
        return options


SCALE_FIELDS = tuple(f.name for f in fields(ScaleOptions))


def deployment(
    settings: Settings, options: ScaleOptions, *, replica_class: type[Replica] | None = None
) -> Application:
    """The gptserve deployment for these settings, bound and ready for `serve.run`.

    `replica_class` replaces `Replica` with a subclass of it (the tests inject faults that way).
    """
    check_settings(settings.validate())
    options.validate()

    def build_asgi_app() -> FastAPI:  # called in each replica, after Replica.__init__
        return replica_app(settings, options)

    ingress = serve.ingress(build_asgi_app)(replica_class or Replica)
    replicas = serve.deployment(ingress, **options.deployment_options(settings))
    if not settings.enable_lora_loading:
        return replicas.bind(options)
    book = serve.deployment(
        AdapterBook, name=BOOK_DEPLOYMENT, num_replicas=1, max_ongoing_requests=10_000,
        ray_actor_options={"num_cpus": 0},
    )  # fmt: skip
    return replicas.bind(options, book.bind())  # deployed with the replicas, deleted with them


def check_settings(settings: Settings) -> Settings:
    """Raise SettingsError for a setting Ray's replicas do not take; returns `settings`."""
    if settings.serves_many and settings.max_loaded_models is not None:
        raise SettingsError(
            "on Ray, --max-models-per-replica sets how many models a replica holds "
            "(not --max-loaded-models)"
        )
    return settings


class Replica:
    """The deployment's class; `serve.ingress` puts the app from `replica_app` in front of it."""

    def __init__(self, options: ScaleOptions, adapter_book: Any = None) -> None:
        # adapter_book: the record's handle, bound so that Serve deploys the record with the
        # replicas; the app reaches it by name (replica_app)
        self.options = options
        self.loaded = False
        # held: an unreferenced task may be collected
        self.mirror_task: asyncio.Task | None = None
        self.adapter_task: asyncio.Task | None = None  # with an adapter record: its sync

    @property
    def state(self) -> ServerState:
        return self.app.state.server  # `app`: serve.ingress's wrapper provides it

    @property
    def models(self) -> ModelRegistry:
        return self.app.state.models

    async def check_health(self) -> None:
        """Ray's health check. The first one runs while the replica starts: it waits for the
        checkpoint to load (with several models: for --preload's), so no request is routed to a
        replica that is still loading."""
        if not self.loaded:
            await self._start()
            self.loaded = True
        if self.models.many:
            verdict = many_health(self.models)
            if verdict is not None:
                raise RuntimeError(f"unhealthy: {verdict}")
            return
        status, body = self.state.health()
        if status != 200:
            raise RuntimeError(f"unhealthy: {json.dumps(body)}")

    async def _start(self) -> None:
        models, timeout = self.models, self.options.load_timeout
        replica_models: ReplicaModels = self.app.state.replica_models
        if models.many:
            for name in models.settings.preload:  # loading since startup; held in Ray's LRU
                await asyncio.wait_for(replica_models.hold(name), timeout)
            served = ", ".join(models.names())
        else:
            await wait_loaded(self.state, timeout)
            served = self.state.loaded.name
            await replica_models.hold(served)  # requests naming it come here at once
        registry = models.metrics.registry
        self.mirror_task = asyncio.create_task(
            mirror_metrics(MetricsMirror(registry), self.options.metrics_interval)
        )
        sync: AdapterSync | None = self.app.state.adapter_sync
        if sync is not None:
            self.adapter_task = asyncio.create_task(sync.run())
        log.info("replica %s serves %s", replica_id(), served)


async def wait_loaded(state: ServerState, timeout: float) -> None:
    """Return once the engine runs; raise RuntimeError if the load fails or takes too long."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not state.ready:
        if state.load_error is not None:
            raise RuntimeError(f"the model failed to load: {state.load_error}")
        if state.async_engine is not None and state.async_engine.dead:
            raise RuntimeError(f"the engine has stopped: {state.async_engine.dead}")
        if loop.time() > deadline:
            raise RuntimeError(f"the model did not load within {timeout:g} seconds")
        await asyncio.sleep(0.05)


def many_health(models: ModelRegistry) -> str | None:
    """Why a replica of several models cannot serve (its registry stopped, a loaded model's
    engine dead), or None."""
    if not models.running():
        return "the model registry has stopped"
    for name, state in models.loaded():
        if state.async_engine is not None and state.async_engine.dead:
            return f"the engine of {name} has stopped: {state.async_engine.dead}"
    return None


def replica_id() -> str:
    return serve.get_replica_context().replica_id.unique_id


def replica_app(settings: Settings, options: ScaleOptions) -> FastAPI:
    """The replica's app: `create_app` with the keys (and admin keys) in this process's
    environment added, its models held in Ray's LRU (ReplicaModels), adapter loads reaching
    every replica (AdapterFanOut), and a header that names the replica on every response."""
    setup_logging(settings.log_level, settings.log_format)

    def with_env(given: list[str], variable: str) -> list[str]:
        env = [k.strip() for k in os.environ.get(variable, "").split(",") if k.strip()]
        return list(dict.fromkeys([*given, *env]))

    app = create_app(replace(
        settings, api_keys=with_env(settings.api_keys, API_KEYS_ENV),
        admin_api_keys=with_env(settings.admin_api_keys, ADMIN_API_KEYS_ENV),
        # Ray's LRU decides what a replica holds: no idle unloads, its maximum the registry's
        keep_alive=-1 if settings.serves_many else settings.keep_alive,
        max_loaded_models=options.max_models_per_replica if settings.serves_many else None,
    ))  # fmt: skip
    registry: ModelRegistry = app.state.models
    sync = None
    if settings.enable_lora_loading:
        context = serve.get_replica_context()
        book = serve.get_deployment_handle(BOOK_DEPLOYMENT, app_name=context.app_name)
        sync = AdapterSync(book, registry, replica_id())
        app.add_middleware(AdapterFanOut, sync=sync)
    on_loaded = sync.on_loaded if sync is not None else None
    app.state.replica_models = ReplicaModels(
        registry, options.max_models_per_replica, on_loaded
    ).install()
    app.state.adapter_sync = sync
    app.add_middleware(ModelRequests)
    app.add_middleware(ReplicaHeader, replica=replica_id())
    return app


class ReplicaHeader:
    """ASGI middleware: every HTTP response names the replica that answered it."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (REPLICA_HEADER.encode(), replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, named_send)


# ---- metrics ---------------------------------------------------------------------------------


class MetricsMirror:
    """Copies a replica's Prometheus registry into Ray's metrics system.

    Ray exports each series with a `ray_` prefix and the tags `deployment`, `replica` and
    `application` added: gauges stay gauges, counters stay counters (`ray_<name>_total`), and a
    histogram's `_bucket`, `_sum` and `_count` series become gauges of the same names, so
    `histogram_quantile` works on them as on the originals.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        gauge: Callable[..., Any] = serve_metrics.Gauge,
        counter: Callable[..., Any] = serve_metrics.Counter,
    ) -> None:
        self.registry = registry
        self.make_gauge, self.make_counter = gauge, counter
        self.gauges: dict[str, Any] = {}
        self.counters: dict[str, Any] = {}
        self.last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

    def push(self) -> None:
        """Copy the registry's current values (counters as increments since the last push)."""
        for family in self.registry.collect():
            for sample in family.samples:
                name, labels = sample.name, sample.labels
                if name.endswith("_created"):
                    continue
                tags = dict(labels) or None
                if family.type == "counter":
                    key = (family.name, tuple(sorted(labels.items())))
                    delta = sample.value - self.last.get(key, 0.0)
                    self.last[key] = sample.value
                    if delta > 0:
                        self._metric(self.counters, self.make_counter, family.name,
                                     family.documentation, labels).inc(delta, tags=tags)  # fmt: skip
                elif family.type in ("gauge", "histogram"):
                    metric = self._metric(
                        self.gauges, self.make_gauge, name, family.documentation, labels
                    )
                    metric.set(sample.value, tags=tags)

    @staticmethod
    def _metric(
        cache: dict[str, Any], make: Callable[..., Any], name: str, doc: str, labels: dict
    ) -> Any:
        metric = cache.get(name)
        if metric is None:
            metric = cache[name] = make(name, description=doc, tag_keys=tuple(sorted(labels)))
        return metric


async def mirror_metrics(mirror: MetricsMirror, interval: float) -> None:
    """Push the mirror every `interval` seconds until cancelled."""
    while True:
        try:
            mirror.push()
        except Exception:  # a metric Ray refuses must not stop the others for good
            log.exception("copying the metrics into Ray's failed")
        await asyncio.sleep(interval)
