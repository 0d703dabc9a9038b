"""Several models on one server (server.models): a request's model picks one, models load on
demand and unload when idle or when room is needed, bad ones are named and the others serve."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from gptserve.model import GPT, ModelConfig, save_checkpoint
from gptserve.server.metrics import Metrics
from gptserve.server.models.registry import ModelRegistry
from gptserve.server.models.specs import scan_models_dir
from gptserve.server.runtime import LoadedModel, load_model
from gptserve.server.settings import Settings, settings_from_args

from tests.server.conftest import LiveServer, live_server, wait_until

PROMPT = "The quick brown fox"


def save_tiny(path: Path, seed: int) -> Path:
    """A tiny random GPT-2-shaped checkpoint; `seed` makes its weights its own."""
    torch.manual_seed(seed)
    save_checkpoint(GPT(ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=128)), path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models folder: two good checkpoints (alpha, beta) and a file that is no GGUF."""
    root = tmp_path_factory.mktemp("models")
    save_tiny(root / "alpha", 0)
    save_tiny(root / "beta", 1)
    (root / "broken.gguf").write_bytes(b"this is not a gguf file")
    (root / "notes.txt").write_text("not a model")
    return root


def complete(url: str, model: str | None, max_tokens: int = 8) -> httpx.Response:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    if model is not None:
        body["model"] = model
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def loaded_flags(url: str) -> dict[str, bool]:
    cards = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
    return {c["id"]: c["loaded"] for c in cards if c["parent"] is None}


def multi(folder: Path, *flags: str, loader=load_model, wait: bool = False):  # noqa: ANN001, ANN201
    """A live server of alpha and beta (plus flags); waits for the default with --preload."""
    argv = ["--model", str(folder / "alpha"), "--model", str(folder / "beta"), *flags]
    return live_server(settings_from_args(argv, env={}), loader, wait_ready=wait)


@pytest.fixture(scope="module")
def oracle(folder: Path) -> dict[str, str]:
    """Each model's greedy completion on a server of that model alone."""
    texts = {}
    for name in ("alpha", "beta"):
        with live_server(Settings(model=str(folder / name))) as live:
            r = complete(live.url, None)
            assert r.status_code == 200, r.text
            texts[name] = r.json()["choices"][0]["text"]
    assert texts["alpha"] != texts["beta"]  # the two models differ, so routing shows
    return texts


def test_each_request_gets_the_model_it_names(folder: Path, oracle: dict[str, str]) -> None:
    with multi(folder, "--preload", "alpha", wait=True) as live:
        for model in ("beta", "alpha", None, "beta"):
            r = complete(live.url, model)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == (model or "alpha")
            assert r.json()["choices"][0]["text"] == oracle[model or "alpha"]
        chat = httpx.post(
            f"{live.url}/v1/chat/completions", timeout=60,
            json={"model": "beta", "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": 4, "temperature": 0},
        )  # fmt: skip
        assert chat.status_code == 200 and chat.json()["model"] == "beta", chat.text
        tok = httpx.post(f"{live.url}/tokenize", json={"model": "beta", "prompt": "hi"}, timeout=10)
        assert tok.status_code == 200 and tok.json()["count"] > 0
        metrics = httpx.get(f"{live.url}/metrics", timeout=10).text
        assert 'gptserve_generation_tokens_total{model="beta"}' in metrics
        assert 'gptserve_generation_tokens_total{model="alpha"}' in metrics


def test_unknown_model_is_404_naming_the_served_ones(folder: Path) -> None:
    with multi(folder, "--preload", "alpha", wait=True) as live:
        r = complete(live.url, "gamma")
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "gamma" in error["message"]
        assert "alpha" in error["message"] and "beta" in error["message"]
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200


def test_a_model_loads_on_its_first_request(folder: Path, oracle: dict[str, str]) -> None:
    with multi(folder) as live:
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200
        assert loaded_flags(live.url) == {"alpha": False, "beta": False}
        r = complete(live.url, "beta")
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == oracle["beta"]
        assert loaded_flags(live.url) == {"alpha": False, "beta": True}


def test_one_loaded_model_at_a_time_swaps(folder: Path, oracle: dict[str, str]) -> None:
    with multi(folder, "--max-loaded-models", "1") as live:
        for model in ("alpha", "beta", "alpha", "beta"):
            r = complete(live.url, model)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == oracle[model]
            flags = loaded_flags(live.url)
            assert flags == {"alpha": model == "alpha", "beta": model == "beta"}


def test_an_idle_model_unloads_after_keep_alive(folder: Path) -> None:
    with multi(folder, "--keep-alive", "1") as live:
        assert complete(live.url, "alpha").status_code == 200
        assert loaded_flags(live.url)["alpha"]
        assert wait_until(lambda: not loaded_flags(live.url)["alpha"], timeout=10)
        assert complete(live.url, "alpha").status_code == 200  # and loads again


def test_a_model_with_running_requests_is_not_unloaded(folder: Path) -> None:
    """Under --max-loaded-models 1 a request for beta waits while alpha streams, then swaps;
    --keep-alive 0.2 does not unload alpha under its running request either."""
    with multi(folder, "--preload", "alpha", "--max-loaded-models", "1", "--keep-alive", "0.2",
               wait=True) as live:  # fmt: skip
        _slow(live, 0.02)
        done: dict[str, httpx.Response] = {}
        runner = threading.Thread(target=lambda: done.update(a=complete(live.url, "alpha", 60)))
        runner.start()
        assert wait_until(lambda: live.state.busy, timeout=10)
        time.sleep(0.5)  # past alpha's keep-alive, with its request running
        assert loaded_flags(live.url)["alpha"]
        r = complete(live.url, "beta")  # waits for alpha's request to end
        runner.join(60)
        assert r.status_code == 200, r.text
        assert done["a"].status_code == 200, done["a"].text
        assert done["a"].json()["usage"]["completion_tokens"] == 60  # never cut short
        assert loaded_flags(live.url) == {"alpha": False, "beta": True}


def test_a_bad_file_in_the_folder_is_named_and_the_others_serve(folder: Path) -> None:
    specs = {s.name: s for s in scan_models_dir(folder)}
    assert set(specs) == {"alpha", "beta", "broken"}
    assert specs["alpha"].error is None and "not a GGUF file" in specs["broken"].error
    settings = settings_from_args(["--models-dir", str(folder)], env={})
    with live_server(settings, wait_ready=False) as live:
        cards = {c["id"]: c for c in httpx.get(f"{live.url}/v1/models", timeout=10).json()["data"]}
        assert set(cards) == {"alpha", "beta", "broken"}
        assert "not a GGUF file" in cards["broken"]["error"] and not cards["broken"]["loaded"]
        assert cards["alpha"]["error"] is None
        r = complete(live.url, "broken")
        assert r.status_code == 503 and "broken" in r.json()["error"]["message"]
        assert complete(live.url, "beta").status_code == 200


def test_a_failed_load_answers_5xx_naming_the_model_and_the_others_serve(folder: Path) -> None:
    def loader(settings: Settings) -> LoadedModel:
        if settings.served_model_name == "beta":
            raise RuntimeError("simulated: the weights are corrupt")
        return load_model(settings)

    with multi(folder, "--preload", "alpha", loader=loader, wait=True) as live:
        results: list[httpx.Response] = []
        waiters = [
            threading.Thread(target=lambda: results.append(complete(live.url, "beta")))
            for _ in range(2)
        ]
        for w in waiters:
            w.start()
        for w in waiters:
            w.join(60)
        assert [r.status_code for r in results] == [503, 503]
        for r in results:
            assert "'beta' failed to load" in r.json()["error"]["message"], r.text
        assert complete(live.url, "alpha").status_code == 200
        assert httpx.get(f"{live.url}/health", timeout=10).status_code == 200


def test_ollama_keep_alive_zero_unloads_after_the_answer(folder: Path) -> None:
    ollama = pytest.importorskip("ollama")
    with multi(folder) as live:
        client = ollama.Client(host=live.url)
        assert {m.model for m in client.list().models} == {"alpha", "beta"}
        answer = client.generate(model="beta", prompt="hi", options={"num_predict": 4})
        assert answer.done
        assert [m.model for m in client.ps().models] == ["beta"]
        answer = client.generate(
            model="beta", prompt="hi", keep_alive=0, options={"num_predict": 4}
        )  # fmt: skip
        assert answer.done and answer.response is not None
        assert wait_until(lambda: not client.ps().models, timeout=10)
        assert not loaded_flags(live.url)["beta"]


def test_only_an_admin_key_unloads_with_keep_alive_zero(folder: Path) -> None:
    """Unloading a model other keys use is an operator's action: a plain key's keep_alive 0 (or
    anything shorter than --keep-alive) becomes the server's; an admin key's unloads."""
    ollama = pytest.importorskip("ollama")
    with multi(folder, "--api-key", "plain", "--admin-api-key", "boss") as live:
        plain = ollama.Client(host=live.url, headers={"Authorization": "Bearer plain"})
        boss = ollama.Client(host=live.url, headers={"Authorization": "Bearer boss"})
        for keep_alive in (0, "1s"):
            plain.generate(model="beta", prompt="hi", keep_alive=keep_alive,
                           options={"num_predict": 2})  # fmt: skip
        time.sleep(2.5)
        assert [m.model for m in plain.ps().models] == ["beta"]
        boss.generate(model="beta", prompt="hi", keep_alive=0, options={"num_predict": 2})
        assert wait_until(lambda: not boss.ps().models, timeout=10)


def test_a_request_during_an_unload_waits_for_the_reload(folder: Path) -> None:
    settings = settings_from_args(
        ["--model", str(folder / "alpha"), "--model", str(folder / "beta")], env={}
    )

    async def scenario() -> None:
        registry = ModelRegistry(settings, Metrics(by_model=True))
        registry.start()
        try:
            await registry.acquire("alpha")
            unloading = asyncio.create_task(registry.unload("alpha"))
            await asyncio.sleep(0)  # the unload has begun
            assert not registry.state("alpha").ready or registry._entry("alpha").unloading
            state = await registry.acquire("alpha")  # waits, then loads it again
            assert state.ready
            await unloading
            assert [name for name, _ in registry.loaded()] == ["alpha"]
        finally:
            await asyncio.to_thread(registry.stop)

    asyncio.run(scenario())


def test_several_models_flags(folder: Path) -> None:
    s = settings_from_args(["--model", "a=" + str(folder / "alpha"), "--model", "shakespeare"])
    assert s.serves_many and s.model == "a=" + str(folder / "alpha")
    assert s.extra_models == ["shakespeare"]
    one = settings_from_args(["--model", "mine=" + str(folder / "alpha")])
    assert not one.serves_many and one.served_model_name == "mine"
    registry = ModelRegistry(s, Metrics(by_model=True))
    assert registry.names() == ["a", "shakespeare"] and registry.default_name() == "a"


def _slow(live: LiveServer, delay: float) -> None:
    """Make each model step of the default model take `delay` longer."""
    fast = live.engine.model.forward_cached

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(delay)
        return fast(*args, **kwargs)

    live.engine.model.forward_cached = slow
