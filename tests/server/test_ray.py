"""gptserve on Ray Serve: a local Ray (2 CPUs, 127.0.0.1, no dashboard) serving a tiny model from
2 replicas behind Ray's HTTP proxy.

Requests spread over both replicas (each response names its replica), the OpenAI routes, errors,
keys and playground answer through the proxy, streams and disconnect-aborts work through it, each
replica's metrics reach Ray's, a killed replica is replaced while a stream on the other goes on, a
replica whose process lives but whose health check fails is replaced too, and an autoscaled
deployment adds a replica under queue depth. Skipped without Ray installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.parser import text_string_to_metric_families

# Ray's token authentication with a token of this run's, written nowhere; Ray reads these once,
# when it is first imported
RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}
for _key, _value in RAY_ENV.items():
    RAY_ENV[_key] = os.environ.setdefault(_key, _value)

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip(
    "ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')"
)

from gptserve.server.ray.cli import main, parse_app_args, parse_cli  # noqa: E402
from gptserve.server.ray.deployment import (  # noqa: E402
    DEPLOYMENT_NAME,
    REPLICA_HEADER,
    MetricsMirror,
    Replica,
    ScaleOptions,
    deployment,
    replica_id,
    wait_loaded,
)
from gptserve.server.ray.proxy_middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV, OpenAIErrors  # noqa: E402
from gptserve.server.settings import Settings, SettingsError  # noqa: E402

from tests.conftest import save_tiny_gpt  # noqa: E402
from tests.server.conftest import API_KEY, free_port, wait_for_server  # noqa: E402

try:  # the request header that sets the proxy's timeout for one request (Ray 2.x)
    from ray.serve._private.constants import (  # noqa: E402
        SERVE_HTTP_REQUEST_TIMEOUT_S_HEADER as TIMEOUT_HEADER,
    )
except ImportError:
    TIMEOUT_HEADER = None

pytestmark = pytest.mark.timeout(300)

APP = "gptserve"
REPO = Path(__file__).resolve().parents[2]
LONG = 1000  # tokens in a long completion: a few seconds on one CPU thread
DEPLOY_TIMEOUT = 120.0


@dataclass
class Cluster:
    url: str
    metrics_url: str


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model with room for LONG tokens, so a completion outlives a disconnect or a kill."""
    return save_tiny_gpt(tmp_path_factory.mktemp("ray-ckpt") / "tiny-gpt", block_size=1024)


@pytest.fixture(scope="module")
def cluster(long_checkpoint: Path) -> Iterator[Cluster]:
    http_port, metrics_port = free_port(), free_port()
    with pytest.MonkeyPatch.context() as mp:  # the proxy's own errors in OpenAI's shape
        mp.setenv(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            _metrics_export_port=metrics_port,
            _system_config={"metrics_report_interval_ms": 500},
        )
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
            settings = Settings(
                model=str(long_checkpoint), api_keys=[API_KEY], max_num_seqs=8,
                max_body_bytes=20_000,
            )  # fmt: skip
            options = ScaleOptions(num_replicas=2, num_cpus=0.5, metrics_interval=0.5)
            serve.run(deployment(settings, options), name=APP, route_prefix="/")
            yield Cluster(
                f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics"
            )
        finally:
            serve.shutdown()
            ray.shutdown()


@pytest.fixture()
def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def replica_actors(app: str = APP) -> dict[str, str]:
    """Replica id -> actor name, for the replicas alive now."""
    prefix = f"SERVE_REPLICA::{app}#{DEPLOYMENT_NAME}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
    return {name[len(prefix) :]: name for name in names if name.startswith(prefix)}


def running_replicas(app: str = APP) -> int:
    status = serve.status().applications[app].deployments[DEPLOYMENT_NAME]
    return status.replica_states.get("RUNNING", 0)


def wait_until(predicate, timeout: float, step: float = 0.2) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


async def _burst(url: str, headers: dict, count: int, max_tokens: int) -> list[httpx.Response]:
    body = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as client:
        return await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(count))
        )


def replicas_answering(url: str, headers: dict, want: set[str] | int, timeout: float) -> set[str]:
    """Replica ids seen in bursts of concurrent completions until `want` (ids, or a count) is
    covered or `timeout` seconds pass."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout

    def covered() -> bool:
        return want <= seen if isinstance(want, set) else len(seen) >= want

    while not covered() and time.monotonic() < deadline:
        for r in asyncio.run(_burst(url, headers, 8, 24)):
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 24
            seen.add(r.headers[REPLICA_HEADER])
    return seen


def replica_metrics(url: str, replica: str, timeout: float = 20.0) -> dict[tuple, float]:
    """One replica's /metrics (asked through the proxy until that replica answers), as
    (sample name, sorted labels) -> value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = httpx.get(f"{url}/metrics", timeout=10)
        if r.headers[REPLICA_HEADER] == replica:
            return {
                (s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(r.text)
                for s in family.samples
            }
    raise AssertionError(f"replica {replica} did not answer /metrics in {timeout:g} s")


def sse_events(lines: Iterator[str]) -> Iterator[dict | str]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


# ---- the pieces, without a cluster ---------------------------------------------------------------


def test_app_args_become_settings_and_scale_options(tmp_path: Path) -> None:
    settings, options = parse_app_args({
        "model": str(tmp_path), "api-key": "a, b", "max_num_seqs": "4",
        "no_prefix_cache": "true", "replicas": "3", "num_cpus": "2",
    })  # fmt: skip
    assert settings.api_keys == ["a", "b"] and settings.max_num_seqs == 4
    assert settings.no_prefix_cache and settings.model == str(tmp_path.resolve())
    assert options.num_replicas == 3 and options.num_cpus == 2.0
    deploy = options.deployment_options(settings)
    assert deploy["num_replicas"] == 3 and "autoscaling_config" not in deploy
    assert deploy["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}
    # under Ray a chunk carries 4 tokens unless the arguments say otherwise
    assert settings.stream_interval == 4
    assert parse_app_args({"stream_interval": "1"})[0].stream_interval == 1

    _, scaled = parse_app_args({"min_replicas": 2, "max_replicas": 5, "target_ongoing_requests": 8})
    auto = scaled.deployment_options(Settings())["autoscaling_config"]
    assert auto["min_replicas"] == 2 and auto["max_replicas"] == 5
    assert auto["target_ongoing_requests"] == 8

    for bad in ({"nope": 1}, {"min_replicas": 3, "max_replicas": 2}, {"max_num_seqs": "many"},
                {"num_replicas": 0}, {"max_num_seqs": 0}, {"num_cpus": "lots"}):  # fmt: skip
        with pytest.raises(SettingsError):
            parse_app_args(bad)


def test_health_check_timing_reaches_the_deployment() -> None:
    settings, options = parse_app_args({
        "health_check_period_s": "2", "health_check_timeout_s": "90", "shutdown_grace": "12",
    })  # fmt: skip
    deploy = options.deployment_options(settings)
    assert deploy["health_check_period_s"] == 2.0 and deploy["health_check_timeout_s"] == 90.0
    assert deploy["graceful_shutdown_timeout_s"] == 12.0
    defaults = ScaleOptions().deployment_options(Settings())  # Ray's own defaults
    assert (defaults["health_check_period_s"], defaults["health_check_timeout_s"]) == (10.0, 30.0)
    _, cli_options, _ = parse_cli(["--health-check-timeout-s", "45"])
    assert cli_options.health_check_timeout_s == 45.0
    for bad in ({"health_check_period_s": 0}, {"health_check_timeout_s": "-1"}):
        with pytest.raises(SettingsError, match="must be > 0"):
            parse_app_args(bad)


def test_cli_flags_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    settings, options, address = parse_cli(["--replicas", "2", "--max-num-seqs", "4"])
    assert (options.num_replicas, settings.max_num_seqs, address) == (2, 4, None)
    assert settings.stream_interval == 4
    assert parse_cli(["--stream-interval", "1"])[0].stream_interval == 1
    with pytest.raises(SystemExit) as exit_help:
        parse_cli(["--help"])
    assert exit_help.value.code == 0
    out = capsys.readouterr().out
    assert "--min-replicas" in out and "--target-ongoing-requests" in out and "--api-key" in out
    with pytest.raises(SystemExit) as exit_bad:
        parse_cli(["--replicas", "two"])
    assert exit_bad.value.code == 2
    assert "invalid int value: 'two'" in capsys.readouterr().err
    # a checkpoint that is not there stops it before Ray starts: one error line, status 2
    assert main(["--model", str(Path(os.devnull) / "missing")]) == 2
    assert capsys.readouterr().err.startswith("error: checkpoint directory")
    assert main(["--min-replicas", "3", "--max-replicas", "1"]) == 2


def test_metrics_mirror_copies_gauges_counters_and_histograms() -> None:
    registry = CollectorRegistry()
    tokens = Counter("gptserve_tokens", "t", registry=registry)
    requests = Counter("gptserve_requests", "r", ("status",), registry=registry)
    Gauge("gptserve_running", "g", registry=registry).set(3)
    Histogram("gptserve_latency_seconds", "h", buckets=(1.0,), registry=registry).observe(0.5)
    made: dict[str, FakeMetric] = {}

    def make(name: str, description: str, tag_keys: tuple[str, ...]) -> FakeMetric:
        made[name] = FakeMetric(tag_keys)
        return made[name]

    mirror = MetricsMirror(registry, gauge=make, counter=make)
    tokens.inc(5)
    requests.labels("200").inc(2)
    mirror.push()
    tokens.inc(3)
    mirror.push()
    mirror.push()
    assert made["gptserve_tokens"].incs == [(5, None), (3, None)]  # increments, never twice
    assert made["gptserve_requests"].incs == [(2, {"status": "200"})]
    assert made["gptserve_requests"].tag_keys == ("status",)
    assert made["gptserve_running"].sets[-1] == (3, None)
    assert made["gptserve_latency_seconds_count"].sets[-1] == (1, None)
    assert made["gptserve_latency_seconds_sum"].sets[-1] == (0.5, None)
    assert made["gptserve_latency_seconds_bucket"].sets[-1] == (1, {"le": "+Inf"})


@dataclass
class FakeMetric:
    tag_keys: tuple[str, ...]

    def __post_init__(self) -> None:
        self.incs: list[tuple[float, dict | None]] = []
        self.sets: list[tuple[float, dict | None]] = []

    def inc(self, value: float, tags: dict | None = None) -> None:
        self.incs.append((value, tags))

    def set(self, value: float, tags: dict | None = None) -> None:
        self.sets.append((value, tags))


async def through_proxy_errors(*messages: dict, fail: bool = False) -> list[dict]:
    """What OpenAIErrors sends when the app inside it sends `messages` (then raises, if `fail`)."""

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        for message in messages:
            await send(message)
        if fail:
            raise RuntimeError("the replica died")

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await OpenAIErrors(app)({"type": "http"}, None, send)
    return sent


def _start(status: int, kind: bytes) -> dict:
    return {"type": "http.response.start", "status": status, "headers": [(b"content-type", kind)]}


def _body(data: bytes, more: bool = False) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


def test_proxy_errors_get_the_openai_shape() -> None:
    sent = asyncio.run(
        through_proxy_errors(
            _start(503, b"text/plain"), _body(b"Deployment ", True), _body(b"unavailable.")
        )  # fmt: skip
    )
    assert sent[0]["status"] == 503
    head = dict(sent[0]["headers"])
    assert head[b"content-type"] == b"application/json"
    body = b"".join(m["body"] for m in sent[1:])
    assert int(head[b"content-length"]) == len(body)
    assert json.loads(body)["error"] == {"message": "Deployment unavailable.", "param": None,
                                         "type": "server_error", "code": "unavailable"}  # fmt: skip
    # nothing answered (a replica died before its answer): a 503 in the same shape
    for sent in (asyncio.run(through_proxy_errors()), asyncio.run(through_proxy_errors(fail=True))):
        assert sent[0]["status"] == 503 and dict(sent[0]["headers"])[b"retry-after"] == b"1"
        assert json.loads(sent[1]["body"])["error"]["code"] == "replica_lost"
    # a stream cut short ends with an error event and [DONE]
    sent = asyncio.run(
        through_proxy_errors(
            _start(200, b"text/event-stream"), _body(b"data: {}\n\n", True), fail=True
        )  # fmt: skip
    )
    tail = sent[-1]["body"].decode().split("\n\n")
    assert json.loads(tail[0][len("data: ") :])["error"]["code"] == "replica_lost"
    assert tail[1] == "data: [DONE]" and sent[-1]["more_body"] is False
    # JSON errors, whole streams and plain-text successes pass through untouched
    for messages in (
        (_start(400, b"application/json"), _body(b'{"error": {}}')),
        (_start(200, b"text/event-stream"), _body(b"data: [DONE]\n\n")),
        (_start(200, b"text/plain"), _body(b"fine")),
    ):
        assert asyncio.run(through_proxy_errors(*messages)) == list(messages)


def test_a_replica_is_ready_once_loaded_and_fails_on_a_load_error() -> None:
    state = SimpleNamespace(ready=False, load_error=None, async_engine=None)

    async def load_later() -> None:
        await asyncio.sleep(0.1)
        state.ready = True

    async def both() -> None:
        await asyncio.gather(wait_loaded(state, timeout=5), load_later())

    asyncio.run(both())
    state.ready, state.load_error = False, "config.json: bad JSON"
    with pytest.raises(RuntimeError, match="the model failed to load: config.json: bad JSON"):
        asyncio.run(wait_loaded(state, timeout=5))
    state.load_error = None
    with pytest.raises(RuntimeError, match="did not load within 0.1 seconds"):
        asyncio.run(wait_loaded(state, timeout=0.1))


def test_cli_serves_and_stops_on_sigterm(long_checkpoint: Path, headers: dict) -> None:
    """`gptserve ray` starts a Ray of its own, serves, and exits 0 on SIGTERM."""
    port = free_port()
    cmd = [sys.executable, "-m", "gptserve.server.ray.cli", "--model", str(long_checkpoint), "--port",
           str(port), "--replicas", "1", "--num-cpus", "0.5", "--api-key", API_KEY]  # fmt: skip
    env = {**os.environ, **RAY_ENV}
    # its own process group, as under a service manager: SIGTERM reaches it alone
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(url, proc, timeout=DEPLOY_TIMEOUT)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 3},
                       headers=headers, timeout=30)  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert REPLICA_HEADER in r.headers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode == 0, err[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


# ---- the running deployment --------------------------------------------------------------------


def test_requests_spread_over_both_replicas(cluster: Cluster, headers: dict) -> None:
    assert running_replicas() == 2
    ids = set(replica_actors())
    assert len(ids) == 2
    assert replicas_answering(cluster.url, headers, ids, timeout=60) == ids


def test_the_openai_client_through_the_proxy(cluster: Cluster) -> None:
    openai = pytest.importorskip("openai", reason="the openai client is not installed")
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key=API_KEY, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny-gpt"]
    out = client.completions.create(model="tiny-gpt", prompt="Hi", max_tokens=5, temperature=0)
    assert out.usage.completion_tokens == 5
    chat = client.chat.completions.create(
        model="tiny-gpt", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.choices[0].message.role == "assistant"


def assert_openai_error(
    r: httpx.Response, status: int, code: str | None, param: str | None = None
) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["code"], err["param"]) == (code, param)


def test_routes_errors_keys_and_playground_through_the_proxy(
    cluster: Cluster, headers: dict
) -> None:
    error = assert_openai_error
    url = f"{cluster.url}/v1/completions"
    error(httpx.post(url, json={"prompt": "x"}), 401, "invalid_api_key")
    error(httpx.post(url, json={"prompt": "x", "max_tokens": -1}, headers=headers), 400, None,
          "max_tokens")  # fmt: skip
    error(httpx.post(url, json={"prompt": "x", "model": "other"}, headers=headers), 404,
          "model_not_found", "model")  # fmt: skip
    bad_json = {**headers, "content-type": "application/json"}
    error(httpx.post(url, content=b"{not json", headers=bad_json), 400, None)
    error(httpx.post(url, content=b"x" * 30_000, headers=bad_json), 413, "request_too_large")
    error(httpx.get(f"{cluster.url}/nowhere"), 404, "not_found")

    health = httpx.get(f"{cluster.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    page = httpx.get(f"{cluster.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "gptserve_generation_tokens_total" in httpx.get(f"{cluster.url}/metrics").text


@pytest.mark.skipif(TIMEOUT_HEADER is None, reason="this Ray has no per-request timeout header")
def test_an_error_of_the_proxy_itself_has_the_openai_shape(cluster: Cluster, headers: dict) -> None:
    """The proxy's own per-request timeout answers a 408 in OpenAI's shape, not plain text."""
    slow = {"prompt": "x", "max_tokens": LONG, "ignore_eos": True}
    r = httpx.post(f"{cluster.url}/v1/completions", json=slow,
                   headers={**headers, TIMEOUT_HEADER: "0.2"}, timeout=60)  # fmt: skip
    assert_openai_error(r, 408, "timeout")


def test_stream_and_disconnect_abort_through_the_proxy(cluster: Cluster, headers: dict) -> None:
    url = f"{cluster.url}/v1/completions"
    body = {"prompt": "ROMEO:", "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(url, json=body, headers=headers, timeout=60).json()
    stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url, json=stream, headers=headers, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == whole["choices"][0]["text"]  # the same greedy text from either replica
    assert chunks[-1]["usage"]["completion_tokens"] == 24

    long = {"prompt": "ROMEO:", "max_tokens": LONG, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=long, headers=headers, timeout=60) as r:
        replica = r.headers[REPLICA_HEADER]
        lines = r.iter_lines()
        for _ in range(3):
            next(event for event in sse_events(lines))
    # the client has hung up after 3 events: that replica aborts the request and frees it
    key = ("gptserve_requests_total", (("endpoint", "completion"), ("finish_reason", "none"),
           ("status", "disconnected")))  # fmt: skip

    def aborted() -> bool:
        samples = replica_metrics(cluster.url, replica)
        idle = samples[("gptserve_num_requests_running", ())] == 0
        return idle and samples.get(key, 0) >= 1

    assert wait_until(aborted, timeout=30, step=0.1), "the disconnected stream was not aborted"


def test_each_replica_metrics_reach_ray(cluster: Cluster, headers: dict) -> None:
    ids = set(replica_actors())
    replicas_answering(cluster.url, headers, ids, timeout=60)
    found: dict[str, set[str]] = {}

    def mirrored() -> bool:
        found.clear()
        text = httpx.get(cluster.metrics_url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith("ray_gptserve_") and s.labels.get("deployment") == "gptserve":
                    found.setdefault(s.name, set()).add(s.labels["replica"])
        wanted = ("ray_gptserve_generation_tokens_total", "ray_gptserve_num_requests_running",
                  "ray_gptserve_e2e_request_latency_seconds_count")  # fmt: skip
        return all(ids <= found.get(name, set()) for name in wanted)

    assert wait_until(mirrored, timeout=60, step=0.5), f"mirrored series: {found}"


def test_killed_replica_is_replaced_and_the_other_keeps_streaming(
    cluster: Cluster, headers: dict
) -> None:
    before = replica_actors()
    assert len(before) == 2
    url = f"{cluster.url}/v1/completions"
    long = {"prompt": "JULIET:", "max_tokens": LONG, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with contextlib.ExitStack() as stack:
        # a long stream on each replica (the router sends the next one to the idler replica)
        streams: dict[str, tuple[Iterator, list]] = {}
        deadline = time.monotonic() + 60
        while len(streams) < 2 and time.monotonic() < deadline:
            r = stack.enter_context(httpx.stream("POST", url, json=long, headers=headers,
                                                 timeout=120))  # fmt: skip
            events = sse_events(r.iter_lines())
            first = [next(events) for _ in range(2)]
            streams.setdefault(r.headers[REPLICA_HEADER], (events, first))
        assert set(streams) == set(before), "no stream landed on each replica"
        victim, survivor = sorted(before)
        ray.kill(ray.get_actor(before[victim], namespace="serve"), no_restart=True)
        done = {rid: first + list(events) for rid, (events, first) in streams.items()}
    # the other replica's stream goes on to the end
    assert done[survivor][-1] == "[DONE]"
    chunks = done[survivor][:-1]
    assert not [c for c in chunks if "error" in c]
    assert chunks[-1]["usage"]["completion_tokens"] == LONG
    # the killed replica's stream ends as the API ends a failed stream: an error event, [DONE]
    assert done[victim][-1] == "[DONE]"
    assert done[victim][-2]["error"]["code"] == "replica_lost"

    def replaced() -> bool:
        now = replica_actors()
        return victim not in now and len(now) == 2 and running_replicas() == 2

    assert wait_until(replaced, timeout=DEPLOY_TIMEOUT), f"replicas now: {replica_actors()}"
    (newcomer,) = set(replica_actors()) - {survivor}
    seen = replicas_answering(cluster.url, headers, {survivor, newcomer}, timeout=60)
    assert seen == {survivor, newcomer}


def replica_that_falls_sick(marker_dir: Path) -> type[Replica]:
    """A Replica whose engine thread dies of an injected fault once the file `marker_dir/<its
    replica id>` exists: its process lives on and answers, but `/health` and so Ray's health
    check fail. (Defined in a function so that Ray ships the class by value to the replicas.)"""

    def injected_fault() -> bool:
        raise RuntimeError("injected fault")

    class FallsSick(Replica):
        async def check_health(self) -> None:
            if self.loaded and (marker_dir / replica_id()).exists():
                engine = self.state.async_engine.engine
                engine.has_work = injected_fault  # the engine loop's next turn
            await super().check_health()

    return FallsSick


def first_response(
    ask: Callable[[], httpx.Response], wanted: Callable[[httpx.Response], bool], timeout: float
) -> httpx.Response:
    """The first answer of `ask()` that is `wanted`, asking every 0.1 s for `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = ask()
        if wanted(r):
            return r
        time.sleep(0.1)
    raise AssertionError(f"no wanted answer in {timeout:g} s; the last: {r.status_code} {r.text}")


def test_a_replica_that_fails_its_health_check_is_replaced(
    cluster: Cluster, long_checkpoint: Path, headers: dict, tmp_path: Path
) -> None:
    """Not a dead process: a replica whose engine has died keeps running and answering, and
    only its failing health checks tell Ray to replace it. Requests then succeed again."""
    settings = Settings(model=str(long_checkpoint), api_keys=[API_KEY], max_num_seqs=4,
                        shutdown_grace=2)  # fmt: skip
    options = ScaleOptions(num_replicas=1, num_cpus=0.25, health_check_period_s=1,
                           health_check_timeout_s=5, metrics_interval=0.5)  # fmt: skip
    app = deployment(settings, options, replica_class=replica_that_falls_sick(tmp_path))
    serve.run(app, name="sick", route_prefix="/sick")
    try:
        base = f"{cluster.url}/sick"
        body = {"prompt": "Hi", "max_tokens": 3}
        (victim,) = replica_actors("sick")

        def complete() -> httpx.Response:
            return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=30)

        r = complete()
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == victim, r.text

        (tmp_path / victim).touch()  # its next health check breaks its engine
        # the sick replica says so itself, from a process that still answers
        sick = first_response(lambda: httpx.get(f"{base}/health", timeout=10),
                              lambda r: r.status_code != 200, timeout=30)  # fmt: skip
        assert sick.status_code == 503 and sick.headers[REPLICA_HEADER] == victim
        assert (
            sick.json()["status"] == "dead" and "injected fault" not in sick.json()["error"]
        )  # in the log only

        def replaced() -> bool:
            now = replica_actors("sick")
            return len(now) == 1 and victim not in now and running_replicas("sick") == 1

        # three failed checks a second apart, a 2 s drain, and a new replica's load
        assert wait_until(replaced, timeout=DEPLOY_TIMEOUT), f"replicas: {replica_actors('sick')}"
        (newcomer,) = replica_actors("sick")
        for _ in range(3):
            r = complete()
            assert r.status_code == 200, r.text
            assert r.headers[REPLICA_HEADER] == newcomer
            assert r.json()["usage"]["completion_tokens"] == 3
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] == "ok"
    finally:
        serve.delete("sick")


def test_autoscaling_adds_a_replica_under_queue_depth(
    cluster: Cluster, long_checkpoint: Path, headers: dict
) -> None:
    settings = Settings(model=str(long_checkpoint), api_keys=[API_KEY], max_num_seqs=8)
    options = ScaleOptions(
        min_replicas=1, max_replicas=2, target_ongoing_requests=1, upscale_delay_s=0,
        downscale_delay_s=600, look_back_period_s=11, num_cpus=0.25, metrics_interval=0.5,
    )  # fmt: skip
    serve.run(deployment(settings, options), name="scaled", route_prefix="/scaled")
    try:
        assert running_replicas("scaled") == 1
        base = f"{cluster.url}/scaled"

        async def load_until_scaled() -> None:
            body = {"prompt": "x", "max_tokens": 200, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=base, headers=headers, timeout=60) as client:

                async def one() -> None:
                    while len(replica_actors("scaled")) < 2:
                        r = await client.post("/v1/completions", json=body)
                        assert r.status_code == 200, r.text

                await asyncio.wait_for(asyncio.gather(*(one() for _ in range(6))), DEPLOY_TIMEOUT)

        asyncio.run(load_until_scaled())
        assert wait_until(lambda: running_replicas("scaled") == 2, timeout=DEPLOY_TIMEOUT)
    finally:
        serve.delete("scaled")


def test_a_checkpoint_that_fails_to_load_fails_the_deployment(
    cluster: Cluster, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    options = ScaleOptions(num_replicas=1, num_cpus=0.25)
    with pytest.raises(RuntimeError):
        serve.run(deployment(Settings(model=str(broken)), options), name="broken",
                  route_prefix="/broken")  # fmt: skip
    status = serve.status().applications["broken"]
    assert status.status == "DEPLOY_FAILED"
    assert "the model failed to load" in status.deployments[DEPLOYMENT_NAME].message
    serve.delete("broken")
    # the working application kept serving
    assert httpx.get(f"{cluster.url}/health", timeout=10).status_code == 200
