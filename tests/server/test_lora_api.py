"""LoRA adapters over HTTP: `--lora NAME=DIR`, /v1/models listing each adapter with its parent,
a request's `model` picking its adapter in mixed concurrent batches (each answer the one of its
own adapter), and vLLM's load/unload endpoints with their errors; an adapter unloaded while a
request uses it lets the request finish."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from gptserve.model import GPT, ModelConfig, get_tokenizer, load_checkpoint
from gptserve.model.lora.peft_format import write_peft
from gptserve.server.runtime import ModelLoadError, load_model
from gptserve.server.settings import Settings, SettingsError, settings_from_args

from tests.lora_testing import greedy_with_logprobs, merged, random_adapter
from tests.server.conftest import API_KEY, MODEL_NAME, live_server, slow_steps, wait_until

C = "/v1/completions"
N_TOKENS = 4
ADMIN_KEY = "admin-key-456"  # loads and unloads (server.admin); API_KEY only uses the models


@pytest.fixture(scope="module")
def dirs(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """PEFT directories for the tiny checkpoint (a, b, c, d of rank 4; big of rank 16) and one
    for another base (other)."""
    root = tmp_path_factory.mktemp("adapters")
    config = load_checkpoint(tiny_checkpoint).config
    out = {}
    for i, name in enumerate(["a", "b", "c", "d"]):
        write_peft(random_adapter(config, name, seed=i), root / name, config, MODEL_NAME)
        out[name] = root / name
    write_peft(random_adapter(config, "big", rank=16), root / "big", config, MODEL_NAME)
    other = ModelConfig(n_layer=2, n_head=4, n_embd=32, block_size=64)
    write_peft(random_adapter(other, "other"), root / "other", other, "another")
    out["big"], out["other"] = root / "big", root / "other"
    return out


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path, dirs: dict[str, Path]):
    settings = Settings(
        model=str(tiny_checkpoint), api_keys=[API_KEY], max_num_seqs=8, max_loras=3,
        max_lora_rank=8, lora=[f"a={dirs['a']}", f"b={dirs['b']}"], enable_lora_loading=True,
        admin_api_keys=[ADMIN_KEY], lora_roots=[str(dirs["a"].parent)],
    )  # fmt: skip
    with live_server(settings) as server:
        yield server


@pytest.fixture(scope="module")
def oracle(tiny_checkpoint: Path, dirs: dict[str, Path]):
    """name -> the float model with that adapter merged (None: the base)."""
    from gptserve.model.lora.peft_format import read_peft

    base: GPT = load_checkpoint(tiny_checkpoint)
    models = {None: merged(base, None)}
    for name in ("a", "b", "c"):
        models[name] = merged(base, read_peft(dirs[name], base.config))
    return models


def _post(live, path: str, body: dict, key: str = API_KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(live.url + path, json=body, headers=headers, timeout=60)


def _admin(live, path: str, body: dict) -> httpx.Response:
    return _post(live, path, body, ADMIN_KEY)


def _complete(live, model: str | None, prompt: list[int]) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": N_TOKENS, "temperature": 0, "logprobs": 0,
            "ignore_eos": True}  # fmt: skip
    if model is not None:
        body["model"] = model
    return _post(live, C, body)


def _check_answer(r: httpx.Response, oracle, name: str | None, prompt: list[int]) -> None:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == (name or MODEL_NAME)
    tokens, lps = greedy_with_logprobs(oracle[name], prompt, N_TOKENS)
    choice = body["choices"][0]
    assert choice["text"] == get_tokenizer().decode(tokens), name
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lps, abs=2e-4), name


def test_models_lists_each_adapter_with_its_parent(live, dirs) -> None:
    r = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    cards = {c["id"]: c for c in r.json()["data"]}
    assert set(cards) == {MODEL_NAME, "a", "b"}
    assert cards[MODEL_NAME]["parent"] is None
    assert cards["a"]["parent"] == cards["b"]["parent"] == MODEL_NAME
    assert cards["a"]["root"] == "a"  # a name, not the directory: API_KEY is not an admin
    r = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert {c["id"]: c["root"] for c in r.json()["data"]}["a"] == str(dirs["a"])


def test_mixed_concurrent_requests_each_get_their_adapter(live, oracle) -> None:
    g = torch.Generator().manual_seed(0)
    work = [(name, torch.randint(0, 50000, (4 + i % 3,), generator=g).tolist())
            for i, name in enumerate(["a", None, "b", "a", MODEL_NAME, "b", "a", None])]  # fmt: skip
    with ThreadPoolExecutor(len(work)) as pool:
        answers = list(pool.map(lambda w: _complete(live, *w), work))
    for (name, prompt), r in zip(work, answers):
        _check_answer(r, oracle, None if name == MODEL_NAME else name, prompt)


def test_an_unknown_model_is_404(live) -> None:
    r = _complete(live, "nope", [1, 2, 3])
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'a'" in error["message"]  # it names what is served


def test_load_and_unload_with_their_errors(live, dirs, oracle) -> None:
    def load(name: str, path: Path | str) -> httpx.Response:
        return _admin(live, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})

    def error(r: httpx.Response, status: int, code: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["error"]["code"] == code, r.text

    error(load("x", dirs["a"].parent / "missing"), 400, "lora_path_invalid")
    error(load("x", dirs["big"]), 400, "lora_rank_too_large")
    error(load("x", dirs["other"]), 400, "lora_base_mismatch")
    error(load("a", dirs["c"]), 400, "lora_name_taken")
    error(load(MODEL_NAME, dirs["c"]), 400, "lora_name_taken")
    r = _admin(live, "/v1/load_lora_adapter", {"lora_name": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert load("c", dirs["c"]).status_code == 200
    error(load("d", dirs["d"]), 400, "lora_slots_full")  # a, b, c fill the 3 slots
    models = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert "c" in {m["id"] for m in models.json()["data"]}
    prompt = [10, 20, 30, 40]
    _check_answer(_complete(live, "c", prompt), oracle, "c", prompt)
    r = _admin(live, "/v1/unload_lora_adapter", {"lora_name": "c"})
    assert r.status_code == 200, r.text
    error(_admin(live, "/v1/unload_lora_adapter", {"lora_name": "c"}), 404, "lora_not_found")
    error(_complete(live, "c", prompt), 404, "model_not_found")
    assert load("d", dirs["d"]).status_code == 200  # its slot is free again
    assert _admin(live, "/v1/unload_lora_adapter", {"lora_name": "d"}).status_code == 200


def test_an_adapter_unloaded_in_use_lets_its_request_finish(live, dirs, oracle) -> None:
    body = {"lora_name": "c", "lora_path": str(dirs["c"])}
    assert _admin(live, "/v1/load_lora_adapter", body).status_code == 200
    prompt = [5, 6, 7, 8, 9]
    slow_steps(live, 0.1)
    answer: dict[str, httpx.Response] = {}
    try:
        thread = threading.Thread(target=lambda: answer.update(r=_complete(live, "c", prompt)))
        thread.start()
        assert wait_until(lambda: live.engine.num_running > 0)
        r = _admin(live, "/v1/unload_lora_adapter", {"lora_name": "c"})
        assert r.status_code == 200, r.text
        thread.join(60)
    finally:
        del live.engine.model.forward_cached  # the model's own again
    _check_answer(answer["r"], oracle, "c", prompt)
    assert wait_until(lambda: live.engine.adapters.bank.slots.count(None) == 1)  # c's is empty


def test_the_endpoints_are_off_by_default(server) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        body = {"lora_name": "a", "lora_path": "/tmp"}
        r = httpx.post(server.url + path, json=body, headers=headers, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_bad_lora_flags_are_one_line_errors(tiny_checkpoint: Path, dirs) -> None:
    for argv, match in (
        (["--lora", "nameonly"], "expected NAME=DIR"),
        (["--lora", f"a={dirs['a']}", "--lora", f"a={dirs['b']}"], "a name of its own"),
        (["--lora", f"a={dirs['a']}", "--max-loras", "0"], "--max-loras must be"),
        (["--lora", f"a={dirs['a']}", "--batch-invariant"], "cannot hold with LoRA"),
    ):
        with pytest.raises(SettingsError, match=match):
            settings_from_args(["--model", str(tiny_checkpoint), *argv], env={})
    settings = Settings(
        model=str(tiny_checkpoint), lora=[f"big={dirs['big']}"], max_lora_rank=8
    ).validate()
    with pytest.raises(ModelLoadError, match=r"--lora big: .* rank \d+, above --max-lora-rank 8"):
        load_model(settings)
    settings = Settings(model=str(tiny_checkpoint), lora=[f"o={dirs['other']}"]).validate()
    with pytest.raises(ModelLoadError, match="--lora o: ") as info:
        load_model(settings)
    assert "\n" not in str(info.value)
    missing = Settings(model=str(tiny_checkpoint), lora=[f"m={dirs['a']}-missing"]).validate()
    with pytest.raises(ModelLoadError, match="no adapter directory"):
        load_model(missing)
    assert json.loads((dirs["a"] / "adapter_config.json").read_text())["r"] == 4
