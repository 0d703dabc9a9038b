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
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, buckets=buckets, registry=registry)

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=registry)

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
        self.responses = counter(
            "gptserve_http_responses", "HTTP responses by status code.", ("status",)
        )
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
