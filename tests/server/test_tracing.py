"""--otlp-traces-endpoint: a span per request, sent over OTLP HTTP/protobuf to a receiver of the
test's own, with the GenAI attributes and the caller's W3C trace continued; without the flag the
OpenTelemetry SDK is never imported."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from gptserve.server.settings import Settings, SettingsError, settings_from_args
from gptserve.server.tracing import traces_url

from tests.server.conftest import live_server, wait_until

pytest.importorskip("opentelemetry.sdk.trace")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue  # noqa: E402
from opentelemetry.proto.trace.v1.trace_pb2 import Span  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


class Receiver:
    """An OTLP/HTTP traces endpoint on 127.0.0.1: the spans every export brought, by path."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, Span]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.headers["Content-Type"] == "application/x-protobuf"
                export = ExportTraceServiceRequest.FromString(body)
                with receiver.lock:
                    for resource in export.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans += [(self.path, span) for span in scope.spans]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def span(self, name: str, trace_id: bytes | None = None) -> Span | None:
        with self.lock:
            for _, span in self.spans:
                if span.name == name and (trace_id is None or span.trace_id == trace_id):
                    return span
        return None

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(span: Span) -> dict:
    """The span's attributes as Python values (an array as a list)."""

    def value(v: AnyValue) -> object:
        kind = v.WhichOneof("value")
        if kind == "array_value":
            return [value(x) for x in v.array_value.values]
        return getattr(v, kind)

    return {a.key: value(a.value) for a in span.attributes}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tiny_checkpoint: Path, receiver: Receiver) -> Iterator:
    mp = pytest.MonkeyPatch()
    mp.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export within 50 ms, not 5 s
    # no path: the exporter posts to /v1/traces
    settings = Settings(model=str(tiny_checkpoint), otlp_traces_endpoint=receiver.url)
    try:
        with live_server(settings) as live:
            yield live
    finally:
        mp.undo()


def test_a_chat_span_continues_the_caller_s_trace_with_the_genai_attributes(
    traced, receiver: Receiver
) -> None:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    body = {
        "messages": [{"role": "user", "content": "Hello there"}],
        "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "seed": 7, "ignore_eos": True,
    }  # fmt: skip
    r = httpx.post(
        traced.url + "/v1/chat/completions", json=body, timeout=60,
        headers={"traceparent": f"00-{trace_id}-{parent_id}-01", "X-Request-Id": "traced-1"},
    )  # fmt: skip
    assert r.status_code == 200, r.text
    name = f"chat {traced.state.loaded.name}"
    assert wait_until(lambda: receiver.span(name, bytes.fromhex(trace_id)), timeout=10)
    span = receiver.span(name, bytes.fromhex(trace_id))
    assert span.parent_span_id == bytes.fromhex(parent_id)  # the caller's span is its parent
    assert span.kind == Span.SPAN_KIND_SERVER
    assert {path for path, _ in receiver.spans} == {"/v1/traces"}
    attrs, usage = attributes(span), r.json()["usage"]
    assert {k: attrs[k] for k in (
        "gen_ai.operation.name", "gen_ai.request.model", "gen_ai.response.model",
        "gen_ai.response.id", "gen_ai.request.id", "gen_ai.usage.input_tokens",
        "gen_ai.usage.output_tokens", "gen_ai.response.finish_reasons",
        "gen_ai.request.max_tokens", "gen_ai.request.temperature", "gen_ai.request.top_p",
        "gen_ai.request.seed", "http.response.status_code", "gptserve.endpoint",
    )} == {
        "gen_ai.operation.name": "chat", "gen_ai.request.model": "tiny-gpt",
        "gen_ai.response.model": "tiny-gpt", "gen_ai.response.id": r.json()["id"],
        "gen_ai.request.id": "traced-1", "gen_ai.usage.input_tokens": usage["prompt_tokens"],
        "gen_ai.usage.output_tokens": usage["completion_tokens"],
        "gen_ai.response.finish_reasons": ["length"], "gen_ai.request.max_tokens": 4,
        "gen_ai.request.temperature": 0.5, "gen_ai.request.top_p": 0.9,
        "gen_ai.request.seed": 7, "http.response.status_code": 200,
        "gptserve.endpoint": "chat",
    }  # fmt: skip
    assert "error.type" not in attrs and "gen_ai.request.choice.count" not in attrs
    queue, ttft = attrs["gen_ai.server.queue_time"], attrs["gen_ai.server.time_to_first_token"]
    duration = attrs["gen_ai.server.request.duration"]
    assert 0 <= queue <= ttft <= duration
    assert (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9 >= duration


def test_a_request_without_traceparent_starts_a_trace_and_every_endpoint_has_its_span(
    traced, receiver: Receiver
) -> None:
    model = traced.state.loaded.name
    r = httpx.post(
        traced.url + "/v1/completions",
        json={"prompt": "Hi", "max_tokens": 2, "n": 2, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200
    emb = httpx.post(
        traced.url + "/v1/embeddings", json={"input": ["one", "two words"]}, timeout=60
    )
    assert emb.status_code == 200
    r = httpx.post(
        traced.url + "/v1/chat/completions", timeout=60,
        json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
    )  # fmt: skip
    assert r.status_code == 200
    for name in (f"text_completion {model}", f"embeddings {model}"):
        assert wait_until(lambda name=name: receiver.span(name), timeout=10), name
    completion = receiver.span(f"text_completion {model}")
    assert completion.parent_span_id == b"" and len(completion.trace_id) == 16
    attrs = attributes(completion)
    assert attrs["gen_ai.request.choice.count"] == 2
    assert attrs["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert attrs["gen_ai.usage.output_tokens"] == 4 and attrs["gen_ai.request.max_tokens"] == 2
    embedding = attributes(receiver.span(f"embeddings {model}"))
    assert embedding["gen_ai.operation.name"] == "embeddings"
    assert embedding["gen_ai.usage.input_tokens"] == emb.json()["usage"]["prompt_tokens"]
    assert embedding["gen_ai.usage.output_tokens"] == 0
    assert "gen_ai.request.temperature" not in embedding


def test_the_endpoint_flag(tmp_path: Path) -> None:
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("http://collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://c.example/otlp/v1/traces") == "https://c.example/otlp/v1/traces"
    assert settings_from_args([], env={}).otlp_traces_endpoint is None
    with pytest.raises(SettingsError, match="--otlp-traces-endpoint must be an http"):
        settings_from_args(["--otlp-traces-endpoint", "localhost:4318"], env={})


OTEL_TRACING = ("opentelemetry.sdk", "opentelemetry.exporter", "opentelemetry.proto")
NOT_IMPORTED = """
import json, sys, time
import fastapi  # FastAPI itself may import opentelemetry's API (its own telemetry)
baseline = {m for m in sys.modules if m.split(".")[0] == "opentelemetry"}
from starlette.testclient import TestClient
from gptserve.server.app import create_app
from gptserve.server.settings import Settings
app = create_app(Settings(model=sys.argv[1]))
with TestClient(app, base_url="http://localhost") as client:
    deadline = time.monotonic() + 60
    while client.get("/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
loaded = {m for m in sys.modules if m.split(".")[0] == "opentelemetry"}
print(json.dumps({"baseline": sorted(baseline), "loaded": sorted(loaded)}))
"""


def test_without_the_flag_opentelemetry_is_not_imported(tiny_checkpoint: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", NOT_IMPORTED, str(tiny_checkpoint)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert not [m for m in seen["loaded"] if m.startswith(OTEL_TRACING)], seen["loaded"]
    # nothing beyond what `import fastapi` loads: a FastAPI with telemetry of its own (off unless
    # a global provider is set) imports opentelemetry's API itself; an older one, nothing at all
    assert seen["loaded"] == seen["baseline"]


MISSING = textwrap.dedent("""
    import sys
    sys.modules["opentelemetry.sdk"] = None  # as if opentelemetry-sdk were not installed
    from gptserve.server.cli import main
    sys.exit(main(sys.argv[1:]))
""")


def test_the_flag_without_the_packages_is_one_error_line_exit_2(tiny_checkpoint: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-c", MISSING, "--model", str(tiny_checkpoint),
         "--otlp-traces-endpoint", "http://127.0.0.1:4318"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: --otlp-traces-endpoint needs the OpenTelemetry packages")
    assert "pip install 'gptserve[otel]'" in out.stderr
