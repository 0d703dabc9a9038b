"""OpenTelemetry traces (`--otlp-traces-endpoint URL`): a span per request, exported over OTLP
HTTP/protobuf, with the GenAI semantic conventions' attributes.

The OpenTelemetry SDK and exporter (`pip install 'gptserve[otel]'`) are imported only when the
flag is set: `check_tracing` at start (a missing package is a one-line error), `RequestTracer`
in `create_app`. The provider is the app's own (the global one is left alone, so FastAPI's own
instrumentation stays off), with a batch processor (OTEL_BSP_* tune it) that the app's shutdown
flushes. A span is made when its request ends, from the request's arrival to then, as vLLM makes
its spans; its parent is the caller's W3C `traceparent` (and `tracestate`), so the span joins the
caller's trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

INSTALL_HINT = (
    "pip install 'gptserve[otel]' (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C trace context, continued by the span
OTLP_TRACES_PATH = "/v1/traces"


class TracingUnavailable(RuntimeError):
    """--otlp-traces-endpoint is set but the OpenTelemetry packages are not installed."""


def check_tracing(endpoint: str | None) -> None:
    """Raise TracingUnavailable when `endpoint` is set and the packages are missing."""
    if endpoint is None:
        return
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry packages ({exc}): {INSTALL_HINT}"
        ) from None


def traces_url(endpoint: str) -> str:
    """The exporter's URL: `endpoint`, with OTLP's /v1/traces when it has no path of its own."""
    parts = urlsplit(endpoint)
    if parts.path in ("", "/"):
        parts = parts._replace(path=OTLP_TRACES_PATH)
    return urlunsplit(parts)


class RequestTracer:
    """The app's tracer provider, OTLP exporter and W3C propagator."""

    def __init__(self, endpoint: str, service_name: str = "gptserve") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.endpoint = traces_url(endpoint)
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(self.endpoint)))
        self.tracer = self.provider.get_tracer("gptserve")
        self.propagator = TraceContextTextMapPropagator()
        self._kind, self._status, self._code = SpanKind.SERVER, Status, StatusCode

    def record(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        trace_headers: Mapping[str, str],
        attributes: Mapping[str, Any],
        error: str | None = None,
    ) -> None:
        """One finished span from `start_ns` to `end_ns` (time.time_ns()), a child of the
        caller's trace context when `trace_headers` carry one; `error` marks it failed."""
        parent = self.propagator.extract(carrier=dict(trace_headers))
        attrs = {k: v for k, v in attributes.items() if v is not None}
        span = self.tracer.start_span(
            name, context=parent, kind=self._kind, start_time=start_ns, attributes=attrs
        )
        if error is not None:
            span.set_status(self._status(self._code.ERROR, error))
        span.end(end_time=end_ns)

    def shutdown(self) -> None:
        """Export what is left and stop (the app's shutdown)."""
        self.provider.shutdown()


def start_tracing(endpoint: str | None) -> RequestTracer | None:
    """The app's tracer, or None (nothing of OpenTelemetry imported) without an endpoint."""
    return None if endpoint is None else RequestTracer(endpoint)
