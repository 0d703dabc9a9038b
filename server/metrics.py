"""Prometheus metrics in a registry of the app's own, so several apps can live in one process."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from server.sequence import TokenEvent

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "gptserve_time_to_first_token_seconds", "Request arrival to its first token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.itl = Histogram(
            "gptserve_inter_token_latency_seconds", "Time between tokens of one completion.",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "gptserve_e2e_request_latency_seconds", "Request arrival to its last token.",
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.step = Histogram(
            "gptserve_engine_step_seconds", "Duration of one engine step.",
            buckets=_TOKEN_BUCKETS, registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "gptserve_prompt_tokens", "Prompt tokens of admitted requests.", registry=r
        )
        self.generation_tokens = Counter(
            "gptserve_generation_tokens", "Tokens generated.", registry=r
        )
        self.requests = Counter(
            "gptserve_requests", "Finished requests by HTTP status and finish reason.",
            ["endpoint", "status", "finish_reason"], registry=r,
        )  # fmt: skip
        self.responses = Counter(
            "gptserve_http_responses", "HTTP responses by status code.", ["status"], registry=r
        )
        self.running = Gauge("gptserve_num_requests_running", "Sequences decoding.", registry=r)
        self.waiting = Gauge("gptserve_num_requests_waiting", "Sequences waiting.", registry=r)
        self.kv_usage = Gauge(
            "gptserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use.", registry=r
        )
        self.failed_steps = Gauge(
            "gptserve_engine_failed_steps", "Engine steps that raised.", registry=r
        )

    def watch_engine(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
        failed_steps: Callable[[], float],
    ) -> None:
        """Read the engine's gauges at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_usage.set_function(kv_usage)
        self.failed_steps.set_function(failed_steps)

    def on_step(self, events: list[TokenEvent], seconds: float) -> None:
        """Called by the engine thread after each step."""
        self.step.observe(seconds)
        generated = sum(len(e.token_ids) for e in events)
        if generated:
            self.generation_tokens.inc(generated)

    def count_request(self, endpoint: str, status: int | str, finish_reason: str | None) -> None:
        self.requests.labels(endpoint, str(status), finish_reason or "none").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
