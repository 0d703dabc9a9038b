"""Several models on Ray Serve: a local Ray (2 CPUs, 127.0.0.1) serving 3 tiny models from 2
replicas that hold at most 2 each, through Ray Serve's model multiplexing.

Every answer equals a single-model server's; once warm, each model's requests land on the
replicas that loaded it and nothing loads again; a replica never holds more than its maximum
(the least recently used model goes); a LoRA adapter loaded through the admin API reaches both
replicas that hold its base, and its unload does too. Tested first without a cluster: the application
arguments, the proxy's routing middleware, a replica applying the adapter record to a loaded and
an unloaded base, and a load that fails on another replica being undone everywhere. Skipped
without Ray installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch

RAY_ENV = {  # as tests/server/test_ray.py: Ray reads these once, when it is first imported
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}
for _key, _value in RAY_ENV.items():
    os.environ.setdefault(_key, _value)

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
serve = pytest.importorskip(
    "ray.serve", reason="Ray Serve is not installed (pip install -e '.[ray]')"
)

from gptserve.model import GPT, ModelConfig, load_checkpoint, save_checkpoint  # noqa: E402
from gptserve.model.lora.peft_format import write_peft  # noqa: E402
from gptserve.server.ray.adapter_sync import AdapterFanOut, AdapterSync  # noqa: E402
from gptserve.server.ray.cli import parse_app_args, parse_cli  # noqa: E402
from gptserve.server.ray.deployment import REPLICA_HEADER, ScaleOptions, deployment  # noqa: E402
from gptserve.server.ray.model_routing import (  # noqa: E402
    BASE_MODEL_HEADER,
    MULTIPLEXED_HEADER,
    ModelRouting,
)
from gptserve.server.ray.proxy_middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV  # noqa: E402
from gptserve.server.settings import Settings, SettingsError  # noqa: E402

from tests.lora_testing import random_adapter  # noqa: E402
from tests.server.conftest import API_KEY, free_port, live_server  # noqa: E402

pytestmark = pytest.mark.timeout(400)

APP, BOUNDED = "multi", "bounded"
MODELS = ("m0", "m1", "m2")
ADAPTER = "ad"  # an adapter of m0
ADMIN_KEY = "admin-key-789"
PROMPT = [5, 17, 42, 7]
N_TOKENS = 6
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
DEPLOY_TIMEOUT = 120.0


@dataclass
class Checkpoints:
    models: dict[str, Path]
    adapters: Path  # the --lora-root; the adapter is its ADAPTER folder


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Checkpoints:
    """Three tiny random models of different weights, and a LoRA adapter of m0."""
    root = tmp_path_factory.mktemp("ray-models")
    models = {}
    for seed, name in enumerate(MODELS):
        torch.manual_seed(100 + seed)
        config = ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=256)
        save_checkpoint(GPT(config), root / name)
        models[name] = root / name
    adapters = tmp_path_factory.mktemp("ray-adapters")
    config = load_checkpoint(models["m0"]).config
    write_peft(random_adapter(config, ADAPTER, seed=3), adapters / ADAPTER, config, "m0")
    return Checkpoints(models, adapters)


def completion_body(model: str) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": N_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def references(checkpoints: Checkpoints) -> dict[str, str]:
    """model -> the greedy text of a single-model server (`gptserve serve --model DIR`); the
    adapter's from a server of m0 with `--lora ad=DIR`."""
    texts = {}
    for name, path in checkpoints.models.items():
        with live_server(Settings(model=str(path))) as server:
            r = httpx.post(f"{server.url}/v1/completions", json=completion_body(name), timeout=60)
            texts[name] = r.json()["choices"][0]["text"]
    settings = Settings(model=str(checkpoints.models["m0"]), max_lora_rank=8,
                        lora=[f"{ADAPTER}={checkpoints.adapters / ADAPTER}"])  # fmt: skip
    with live_server(settings) as server:
        r = httpx.post(f"{server.url}/v1/completions", json=completion_body(ADAPTER), timeout=60)
        texts[ADAPTER] = r.json()["choices"][0]["text"]
    assert len({texts[m] for m in MODELS}) == 3, "the three models must answer differently"
    assert texts[ADAPTER] != texts["m0"], "the adapter must change m0's answer"
    return texts


def many_settings(checkpoints: Checkpoints, **extra) -> Settings:  # noqa: ANN003
    first, *others = (str(p) for p in checkpoints.models.values())
    return Settings(model=first, extra_models=others, api_keys=[API_KEY], max_num_seqs=4,
                    **extra)  # fmt: skip


@pytest.fixture(scope="module")
def url(checkpoints: Checkpoints) -> Iterator[str]:
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:  # the proxy routes by model (and shapes errors)
        mp.setenv(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
        ray.init(address="local", num_cpus=2, include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=False)  # fmt: skip
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            settings = many_settings(
                checkpoints, admin_api_keys=[ADMIN_KEY], enable_lora_loading=True,
                lora_roots=[str(checkpoints.adapters)], max_loras=2, max_lora_rank=8,
            )  # fmt: skip
            options = ScaleOptions(num_replicas=2, num_cpus=0.5, max_models_per_replica=2)
            serve.run(deployment(settings, options), name=APP, route_prefix="/")
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()


def complete(base: str, model: str) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=completion_body(model), headers=HEADERS,
                      timeout=60)  # fmt: skip


def answered(r: httpx.Response, references: dict[str, str], model: str) -> str:
    """The replica that answered (through Ray), once the answer is checked against the
    reference."""
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == references[model], model
    return r.headers.get(REPLICA_HEADER, "")


def loaded_models(base: str, replicas: int, timeout: float = 60.0) -> dict[str, set[str]]:
    """replica -> the models it has loaded (its /v1/models), asked until `replicas` answered."""
    seen: dict[str, set[str]] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < replicas and time.monotonic() < deadline:
        r = httpx.get(f"{base}/v1/models", headers=HEADERS, timeout=30)
        assert r.status_code == 200, r.text
        cards = r.json()["data"]
        seen[r.headers[REPLICA_HEADER]] = {
            c["id"] for c in cards if c["parent"] is None and c["loaded"]
        }
    assert len(seen) == replicas, f"only {sorted(seen)} answered /v1/models"
    return seen


# ---- without a cluster -------------------------------------------------------------------------


def test_app_args_name_several_models_with_absolute_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path)
    settings, options = parse_app_args({"model": "a=b,b", "models_dir": ".",
                                        "max_models_per_replica": "2"})  # fmt: skip
    assert settings.model == f"a={tmp_path / 'b'}" and settings.extra_models == [
        str(tmp_path / "b")
    ]
    assert settings.models_dir == str(tmp_path) and options.max_models_per_replica == 2
    cli_settings, cli_options, _ = parse_cli(["--model", "b", "--model", "x=b",
                                             "--max-models-per-replica", "5"])  # fmt: skip
    assert cli_settings.extra_models == [f"x={tmp_path / 'b'}"]
    assert cli_options.max_models_per_replica == 5
    with pytest.raises(SettingsError, match="max_models_per_replica must be >= 1"):
        parse_app_args({"max_models_per_replica": 0})
    with pytest.raises(SettingsError, match="--max-models-per-replica"):
        parse_app_args({"model": "b,x=b", "max_loaded_models": 2})


class Recorder:
    """An app behind ModelRouting: notes the headers and the body it got, answers `answer`."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.answer: list[tuple[bytes, bytes]] = []

    async def __call__(self, scope, receive, send) -> None:  # noqa: ANN001
        self.headers = dict(scope["headers"])
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.body = b"".join(chunks)
        await send({"type": "http.response.start", "status": 200, "headers": self.answer})


def post(routing: ModelRouting, body: bytes, headers: list | None = None) -> None:
    """POST `body` in two parts through `routing`."""
    messages = [{"type": "http.request", "body": body[:5], "more_body": True},
                {"type": "http.request", "body": body[5:], "more_body": False}]  # fmt: skip

    async def receive() -> dict:
        return messages.pop(0)

    async def send(message: dict) -> None:
        pass

    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json"), *(headers or [])]}  # fmt: skip
    asyncio.run(routing(scope, receive, send))


def test_the_proxy_routes_a_request_by_its_model() -> None:
    app = Recorder()
    routing = ModelRouting(app)
    body = json.dumps({"model": "m1", "prompt": "hi"}).encode()
    post(routing, body)
    assert app.headers[MULTIPLEXED_HEADER] == b"m1" and app.body == body
    # a client's own id stays; a body that is no JSON object or names no model goes on as it came
    post(routing, body, [(b"serve-multiplexed-model-id", b"m2")])
    assert MULTIPLEXED_HEADER not in app.headers and app.body == body
    for other in (b"{not json", b'["m1"]', b'{"prompt": "x"}', b'{"model": 3}'):
        post(routing, other)
        assert MULTIPLEXED_HEADER not in app.headers and app.body == other
    # a replica names an adapter's base: the adapter's next requests are routed by the base
    adapter = json.dumps({"model": "ad"}).encode()
    app.answer = [(BASE_MODEL_HEADER.encode(), b"m0")]
    post(routing, adapter)
    assert app.headers[MULTIPLEXED_HEADER] == b"ad"
    app.answer = []
    post(routing, adapter)
    assert app.headers[MULTIPLEXED_HEADER] == b"m0"


def test_a_replica_applies_the_adapter_record_to_loaded_and_unloaded_bases(
    checkpoints: Checkpoints, references: dict[str, str]
) -> None:
    """AdapterSync on a server of the 3 models (no Ray): an adapter recorded for m0 while m0 is
    not loaded comes with m0's load; unloaded, and recorded again while m0 is loaded, it goes
    out of and into m0's engine."""
    source = str(checkpoints.adapters / ADAPTER)
    settings = many_settings(checkpoints, enable_lora_loading=True, max_lora_rank=8,
                             lora_roots=[str(checkpoints.adapters)])  # fmt: skip
    with live_server(settings, wait_ready=False) as server:
        registry = server.app.state.models
        sync = AdapterSync(book=None, registry=registry, replica="r")

        def record(adapters: dict) -> None:
            sync.adapters = {"m0": adapters}
            assert asyncio.run(sync.apply_all()) == {}

        record({ADAPTER: source})
        assert registry.loaded() == [] and registry.state("m0").lora_names == {ADAPTER: source}
        answered(complete(server.url, ADAPTER), references, ADAPTER)  # m0 loads, with it
        record({ADAPTER: None})
        r = complete(server.url, ADAPTER)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        record({ADAPTER: source})
        answered(complete(server.url, ADAPTER), references, ADAPTER)
        answered(complete(server.url, "m0"), references, "m0")


class FakeBook:
    """The adapter record's handle: `record` notes each change; `wait_applied` reports the
    given failures for the first change."""

    def __init__(self, failures: list[str]) -> None:
        self.changes: list[tuple] = []
        self.failures = failures
        self.record = SimpleNamespace(remote=self._record)
        self.wait_applied = SimpleNamespace(remote=self._wait_applied)

    async def _record(self, base: str, name: str, source: str | None) -> int:
        self.changes.append((base, name, source))
        return len(self.changes)

    async def _wait_applied(self, version: int, name: str, timeout: float) -> tuple[list, list]:
        return (self.failures if version == 1 else []), []


def fan_out(book: FakeBook, path: str, body: dict) -> tuple[int, bytes]:
    """Status and body of AdapterFanOut's answer when the replica's own answer is a 200."""

    async def app(scope, receive, send) -> None:  # noqa: ANN001
        await receive()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"Success"})

    state = SimpleNamespace(settings=SimpleNamespace(served_model_name="m0"), loaded=None)
    registry = SimpleNamespace(state=lambda name: state)
    middleware = AdapterFanOut(app, AdapterSync(book, registry, "r"))
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode()}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_an_adapter_load_that_fails_on_another_replica_is_undone_everywhere() -> None:
    load = {"lora_name": "ad", "lora_path": "/roots/ad", "base_model": "m0"}
    book = FakeBook([])
    assert fan_out(book, "/v1/load_lora_adapter", load) == (200, b"Success")
    assert book.changes == [("m0", "ad", "/roots/ad")]
    book = FakeBook(["replica r2: all 2 LoRA slots are in use"])
    status, body = fan_out(book, "/v1/load_lora_adapter", load)
    assert status == 503 and json.loads(body)["error"]["code"] == "lora_load_incomplete"
    assert "all 2 LoRA slots are in use" in json.loads(body)["error"]["message"]
    assert book.changes == [("m0", "ad", "/roots/ad"), ("m0", "ad", None)]  # undone
    book = FakeBook([])
    assert fan_out(book, "/v1/unload_lora_adapter", {"lora_name": "ad"}) == (200, b"Success")
    assert book.changes == [("m0", "ad", None)]


# ---- the running deployment --------------------------------------------------------------------


def test_each_model_answers_as_alone_and_stays_on_its_replicas(
    url: str, references: dict[str, str]
) -> None:
    for _ in range(2):  # warm up: each model loads where Ray sends it first
        for model in MODELS:
            answered(complete(url, model), references, model)
            time.sleep(1.0)  # the replica's models reach Ray's routers
    before = loaded_models(url, replicas=2)
    assert all(len(models) <= 2 for models in before.values()), before
    assert set().union(*before.values()) == set(MODELS), before
    for _ in range(4):
        for model in MODELS:
            replica = answered(complete(url, model), references, model)
            assert model in before[replica], f"{model} went to {replica}, which holds {before}"
    assert loaded_models(url, replicas=2) == before  # nothing loaded or unloaded meanwhile
    r = complete(url, "nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert all(m in r.json()["error"]["message"] for m in MODELS)


def test_a_replica_holds_at_most_its_maximum(
    url: str, checkpoints: Checkpoints, references: dict[str, str]
) -> None:
    options = ScaleOptions(num_replicas=1, num_cpus=0.25, max_models_per_replica=2)
    serve.run(deployment(many_settings(checkpoints), options), name=BOUNDED,
              route_prefix=f"/{BOUNDED}")  # fmt: skip
    try:
        base = f"{url}/{BOUNDED}"
        for model, held in (("m0", {"m0"}), ("m1", {"m0", "m1"}), ("m2", {"m1", "m2"}),
                            ("m0", {"m2", "m0"}), ("m2", {"m2", "m0"})):  # fmt: skip
            answered(complete(base, model), references, model)
            (loaded,) = loaded_models(base, replicas=1).values()
            assert loaded == held, (model, loaded)
    finally:
        serve.delete(BOUNDED)


async def _burst(base: str, model: str, count: int) -> list[httpx.Response]:
    body = completion_body(model)
    async with httpx.AsyncClient(base_url=base, headers=HEADERS, timeout=60) as client:
        return await asyncio.gather(
            *(client.post("/v1/completions", json=body) for _ in range(count))
        )


def answering_replicas(base: str, model: str, status: int, timeout: float = 60.0) -> set[str]:
    """The replicas seen answering `model` (each answer of `status`) in concurrent bursts,
    until two have or `timeout` seconds pass."""
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    while len(seen) < 2 and time.monotonic() < deadline:
        for r in asyncio.run(_burst(base, model, 4)):
            assert r.status_code == status, r.text
            seen.add(r.headers[REPLICA_HEADER])
    return seen


def test_a_lora_adapter_reaches_every_replica_holding_its_base(
    url: str, checkpoints: Checkpoints, references: dict[str, str]
) -> None:
    # m0 onto the replica that lacks it: a request for m0 sent there with Ray's own header
    # naming a model only that replica holds (a client's header is kept by the proxy)
    holders: list[str] = []
    for _ in range(5):
        held = loaded_models(url, replicas=2)
        holders = [r for r, models in held.items() if "m0" in models]
        if len(holders) == 2:
            break
        (lacking,) = set(held) - set(holders)
        others = set().union(*(held[r] for r in holders))
        pin = sorted(held[lacking] - others)[0]
        r = httpx.post(f"{url}/v1/completions", json=completion_body("m0"),
                       headers={**HEADERS, "serve_multiplexed_model_id": pin}, timeout=60)  # fmt: skip
        answered(r, references, "m0")
        time.sleep(1.0)
    assert len(holders) == 2, f"m0 did not get onto both replicas: {held}"

    load = {"lora_name": ADAPTER, "lora_path": str(checkpoints.adapters / ADAPTER),
            "base_model": "m0"}  # fmt: skip
    r = httpx.post(f"{url}/v1/load_lora_adapter", json=load, headers=ADMIN, timeout=90)
    assert r.status_code == 200, r.text
    # right away, through either replica: the adapter's answer, as a server with --lora gives
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 2 and time.monotonic() < deadline:
        seen.add(answered(complete(url, ADAPTER), references, ADAPTER))
    assert seen == set(holders), f"the adapter answered from {seen}; m0 is on {holders}"

    unload = {"lora_name": ADAPTER}
    r = httpx.post(f"{url}/v1/unload_lora_adapter", json=unload, headers=ADMIN, timeout=90)
    assert r.status_code == 200, r.text
    assert answering_replicas(url, ADAPTER, 404) == set(holders)  # gone from both
    answered(complete(url, "m0"), references, "m0")  # the base serves on
