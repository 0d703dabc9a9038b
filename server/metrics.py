"""Prometheus metrics in a registry of the app's own, so several apps can live in one process."""

from __future__ import annotations

from gptserve.engine.async_engine import AsyncEngine, StepStats
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """The app's metrics. With `by_model` (a server of several models, server.models) every
    metric but the HTTP responses has a `model` label, and each model's ServerState counts
    through `for_model(name)`; without it the names and labels are a single-model server's."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, by_model: bool = False) -> None:
        self.registry = registry = CollectorRegistry()
        self.by_model = by_model
        per_model = ("model",) if by_model else ()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, per_model, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, (*per_model, *labels), registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, per_model, registry=registry)

        latency, per_token = _LATENCY_BUCKETS, _TOKEN_BUCKETS
        self.ttft = histogram(
            "gptserve_time_to_first_token_seconds", "Request arrival to its first token.", latency
        )
        self.itl = histogram(
            "gptserve_inter_token_latency_seconds",
            "Time between tokens of one completion.",
            per_token,
        )
        self.e2e = histogram(
            "gptserve_e2e_request_latency_seconds", "Request arrival to its last token.", latency
        )
        self.step = histogram(
            "gptserve_engine_step_seconds", "Duration of one engine step.", per_token
        )
        self.prompt_tokens = counter(
            "gptserve_prompt_tokens", "Prompt tokens of admitted requests."
        )
        self.generation_tokens = counter("gptserve_generation_tokens", "Tokens generated.")
        self.preemptions = counter(
            "gptserve_preemptions",
            "Sequences preempted for lack of KV cache blocks (to be recomputed).",
        )
        self.prefix_queries = counter(
            "gptserve_prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = counter(
            "gptserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not recomputed).",
        )
        self.spec_proposed = counter(
            "gptserve_spec_decode_draft_tokens", "Speculative guesses verified by the model."
        )
        self.spec_accepted = counter(
            "gptserve_spec_decode_accepted_tokens",
            "Speculative guesses accepted (acceptance rate: accepted / draft tokens).",
        )
        self.requests = counter(
            "gptserve_requests", "Finished requests by HTTP status and finish reason.",
            ("endpoint", "status", "finish_reason"),
        )  # fmt: skip
        self.responses = Counter(  # of the whole server, never by model
            "gptserve_http_responses", "HTTP responses by status code.", ("status",),
            registry=registry,
        )  # fmt: skip
        self.tool_calls = counter("gptserve_tool_calls", "Tool calls returned to clients.")
        self.running = gauge("gptserve_num_requests_running", "Sequences decoding.")
        self.waiting = gauge("gptserve_num_requests_waiting", "Sequences waiting.")
        self.kv_usage = gauge(
            "gptserve_kv_cache_usage_ratio",
            "Fraction of KV cache blocks held by sequences (cached prefixes nobody holds are free).",
        )
        self.failed_steps = gauge("gptserve_engine_failed_steps", "Engine steps that raised.")
        self.kv_bytes_per_token = gauge(
            "gptserve_kv_cache_bytes_per_token",
            "Key and value bytes one cached token takes (layers x KV heads x head dim x dtype).",
        )

    def for_model(self, name: str) -> Metrics | ModelMetrics:
        """What one model counts through: these metrics' `model=name` children (by_model), else
        the metrics themselves."""
        return ModelMetrics(self, name) if self.by_model else self

    def unwatch(self) -> None:
        """The engine has stopped (its model unloaded): its gauges read 0 and hold nothing."""
        for gauge in (self.running, self.waiting, self.kv_usage, self.failed_steps):
            gauge.set_function(lambda: 0)

    def watch(self, async_engine: AsyncEngine) -> None:
        """Read the engine's gauges at scrape time and count its steps."""
        self.running.set_function(lambda: async_engine.num_running)
        self.waiting.set_function(lambda: async_engine.num_waiting)
        self.kv_usage.set_function(lambda: async_engine.kv_usage)
        self.failed_steps.set_function(lambda: async_engine.num_failed_steps)
        self.kv_bytes_per_token.set(async_engine.kv_bytes_per_token)  # fixed once it is built
        async_engine.on_step = self.on_step

    def on_step(self, stats: StepStats) -> None:
        """Called by the engine thread after each step."""
        self.step.observe(stats.seconds)
        generated = sum(len(e.token_ids) for e in stats.events)
        if generated:
            self.generation_tokens.inc(generated)
        if stats.preempted:
            self.preemptions.inc(stats.preempted)
        if stats.prefix_queried:
            self.prefix_queries.inc(stats.prefix_queried)
            self.prefix_hits.inc(stats.prefix_hit)
        if stats.spec_proposed:
            self.spec_proposed.inc(stats.spec_proposed)
            self.spec_accepted.inc(stats.spec_accepted)

    def count_request(self, endpoint: str, status: int | str, finish_reason: str | None) -> None:
        self.requests.labels(endpoint, str(status), finish_reason or "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# the metrics a ModelMetrics hands out as its model's children
_PER_MODEL = (
    "ttft", "itl", "e2e", "step", "prompt_tokens", "generation_tokens", "preemptions",
    "prefix_queries", "prefix_hits", "spec_proposed", "spec_accepted", "tool_calls", "running",
    "waiting", "kv_usage", "failed_steps", "kv_bytes_per_token",
)  # fmt: skip


class ModelMetrics(Metrics):
    """One model's view of a by_model Metrics: the same attributes and methods, each metric its
    `model` child; the registry and the HTTP responses are the app's."""

    def __init__(self, parent: Metrics, name: str) -> None:  # no super().__init__: a view
        self.registry, self.by_model, self.model = parent.registry, False, name
        self.responses = parent.responses
        self._requests = parent.requests
        for attr in _PER_MODEL:
            setattr(self, attr, getattr(parent, attr).labels(model=name))

    def count_request(self, endpoint: str, status: int | str, finish_reason: str | None) -> None:
        labels = (self.model, endpoint, str(status), finish_reason or "none")
        self._requests.labels(*labels).inc()
