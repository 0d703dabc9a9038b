"""Who may do what (server.admin): only an --admin-api-key key loads and unloads LoRA adapters
when the server has API keys, a lora_path must resolve inside a --lora-root and every other path
gets one message that does not tell whether it exists, and no answer to another key carries a
server path (/v1/models, a failed load)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gptserve.model import load_checkpoint
from gptserve.model.lora.peft_format import write_peft
from gptserve.server.lora_api import NO_ADAPTER
from gptserve.server.runtime import LoadedModel, ModelLoadError, preflight
from gptserve.server.settings import Settings, SettingsError, settings_from_args

from tests.lora_testing import random_adapter
from tests.server.conftest import MODEL_NAME, LiveServer, live_server, wait_until

USER, OTHER_USER, ADMIN = "user-key-1", "user-key-2", "admin-key-1"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def layout(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A LoRA root holding adapters b and c, a directory that is no adapter, a file, a symlink
    to b (inside) and one to an adapter outside the root; the adapters outside it: a (served
    with --lora) and secret."""
    base = tmp_path_factory.mktemp("lora-layout")
    config = load_checkpoint(tiny_checkpoint).config
    root, outside = base / "root", base / "outside"
    root.mkdir()
    outside.mkdir()
    for i, (directory, name) in enumerate(
        [(root, "b"), (root, "c"), (outside, "a"), (outside, "secret")]
    ):
        write_peft(random_adapter(config, name, seed=i), directory / name, config, MODEL_NAME)
    (root / "empty").mkdir()
    (root / "file.txt").write_text("not an adapter\n")
    (root / "alias").symlink_to(root / "b")
    (root / "escape").symlink_to(outside / "secret")
    return {"root": root, "outside": outside}


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path, layout: dict[str, Path]) -> Iterator[LiveServer]:
    settings = Settings(
        model=str(tiny_checkpoint), api_keys=[USER, OTHER_USER], admin_api_keys=[ADMIN],
        max_num_seqs=4, max_loras=4, lora=[f"a={layout['outside'] / 'a'}"],
        enable_lora_loading=True, lora_roots=[str(layout["root"])],
    )  # fmt: skip
    with live_server(settings) as server:
        yield server


def post(live: LiveServer, path: str, body: dict, key: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(live.url + path, json=body, headers=headers, timeout=60)


def load(live: LiveServer, name: str, path: Path | str, key: str | None = ADMIN) -> httpx.Response:
    return post(live, LOAD, {"lora_name": name, "lora_path": str(path)}, key)


def unload(live: LiveServer, name: str, key: str | None = ADMIN) -> httpx.Response:
    return post(live, UNLOAD, {"lora_name": name}, key)


def complete(live: LiveServer, model: str, key: str = USER) -> httpx.Response:
    body = {"model": model, "prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0}
    return post(live, "/v1/completions", body, key)


def assert_denied(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["type"] == "permission_error" and error["code"] == "permission_denied"
    assert error["param"] is None and "admin" in error["message"]


def assert_no_adapter(r: httpx.Response) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "lora_path_invalid" and error["param"] == "lora_path"
    return error["message"]


def test_a_key_that_is_not_an_admins_gets_403_on_load_and_unload(live, layout) -> None:
    for key in (USER, OTHER_USER):
        assert_denied(load(live, "b", layout["root"] / "b", key))
        assert_denied(unload(live, "a", key))
        assert_denied(post(live, LOAD, {}, key))  # the scope is checked before the body
    assert "b" not in live.state.lora_names
    assert post(live, LOAD, {}, None).status_code == 401  # no key: 401 as everywhere


def test_an_admin_key_loads_and_unloads(live, layout) -> None:
    assert load(live, "b", layout["root"] / "b").status_code == 200
    assert complete(live, "b").status_code == 200
    assert complete(live, "b", ADMIN).status_code == 200  # an admin key is an API key too
    assert unload(live, "b").status_code == 200
    assert complete(live, "b").status_code == 404
    assert load(live, "b2", layout["root"] / "alias").status_code == 200  # a symlink inside
    assert unload(live, "b2").status_code == 200


def test_another_key_cannot_unload_an_adapter_its_requests_keep_working(live, layout) -> None:
    assert load(live, "c", layout["root"] / "c").status_code == 200
    try:
        for name in ("a", "c"):  # --lora's and a loaded one
            assert_denied(unload(live, name, OTHER_USER))
            assert complete(live, name, USER).status_code == 200
        assert set(live.state.lora_names) == {"a", "c"}
    finally:
        assert unload(live, "c").status_code == 200


def test_every_path_that_is_no_adapter_in_a_root_gets_one_message(live, layout) -> None:
    root, outside = layout["root"], layout["outside"]
    paths = [
        outside / "secret",  # an adapter, outside the root
        root / "escape",  # a symlink inside the root to that adapter
        root / ".." / "outside" / "secret",  # the same through ..
        root / "missing",  # nothing there
        outside / "missing",
        root / "empty",  # a directory, no adapter in it
        root / "file.txt",
        "relative/dir",
        "/",
    ]
    messages = {assert_no_adapter(load(live, "x", path)) for path in paths}
    assert messages == {NO_ADAPTER}
    assert str(root) not in NO_ADAPTER and "x" not in live.state.lora_names


def test_without_a_lora_root_no_path_loads(tiny_checkpoint: Path, layout, caplog) -> None:
    """An open server (no key): everyone may load, as before the admin scope, but only from a
    root; with none, every path is refused, and the start says so."""
    root = layout["root"]
    with caplog.at_level(logging.WARNING, logger="gptserve.server.admin"):
        settings = Settings(model=str(tiny_checkpoint), enable_lora_loading=True)
        with live_server(settings) as server:
            message = assert_no_adapter(load(server, "b", root / "b", None))
            assert "--lora-root" in message
    assert any("without --lora-root" in r.getMessage() for r in caplog.records)
    settings = Settings(
        model=str(tiny_checkpoint), enable_lora_loading=True, lora_roots=[str(root)]
    )
    with live_server(settings) as server:
        assert load(server, "b", root / "b", None).status_code == 200
        assert unload(server, "b", None).status_code == 200


def test_keys_without_an_admin_key_refuse_loading_to_every_key(
    tiny_checkpoint: Path, layout, caplog
) -> None:
    root = layout["root"]
    with caplog.at_level(logging.WARNING, logger="gptserve.server.admin"):
        settings = Settings(
            model=str(tiny_checkpoint), api_keys=[USER], enable_lora_loading=True,
            lora_roots=[str(root)],
        )  # fmt: skip
        with live_server(settings) as server:
            assert_denied(load(server, "b", root / "b", USER))
            assert_denied(unload(server, "b", USER))
            assert complete(server, MODEL_NAME).status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("no admin key" in w and "--admin-api-key" in w for w in warnings), warnings


def string_values(node: object) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from string_values(value)
    elif isinstance(node, list):
        for value in node:
            yield from string_values(value)


def test_models_show_no_server_path_to_a_key_that_is_not_an_admins(
    live, layout, tiny_checkpoint: Path
) -> None:
    assert load(live, "c", layout["root"] / "c").status_code == 200
    try:
        r = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {USER}"})
        assert r.status_code == 200
        assert not [s for s in string_values(r.json()) if s.startswith("/")], r.text
        for path in (tiny_checkpoint, layout["root"], layout["outside"]):
            assert str(path) not in r.text
        cards = {c["id"]: c for c in r.json()["data"]}
        assert set(cards) == {MODEL_NAME, "a", "c"}
        assert {i: c["root"] for i, c in cards.items()} == {
            MODEL_NAME: MODEL_NAME,
            "a": "a",
            "c": "c",
        }
        r = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"})
        roots = {c["id"]: c["root"] for c in r.json()["data"]}
        assert roots[MODEL_NAME] == str(tiny_checkpoint)
        assert roots["a"] == str(layout["outside"] / "a")
    finally:
        assert unload(live, "c").status_code == 200


def test_a_failed_load_does_not_tell_a_key_its_reason(tiny_checkpoint: Path) -> None:
    def broken(settings: Settings) -> LoadedModel:
        raise ModelLoadError(f"{tiny_checkpoint}/model.safetensors is unreadable or truncated")

    settings = Settings(model=str(tiny_checkpoint), api_keys=[USER], admin_api_keys=[ADMIN])
    with live_server(settings, loader=broken, wait_ready=False) as server:
        assert wait_until(lambda: server.state.load_error is not None)
        for key in (USER, ADMIN):
            r = complete(server, MODEL_NAME, key)
            assert r.status_code == 503
            error = r.json()["error"]
            assert error["code"] == "model_load_failed" and str(tiny_checkpoint) not in r.text
            assert "server log" in error["message"]


def test_the_flags_and_the_environment(tiny_checkpoint: Path, tmp_path: Path) -> None:
    model = ["--model", str(tiny_checkpoint)]
    env = {"GPTSERVE_ADMIN_API_KEYS": " x, y ,", "GPTSERVE_API_KEYS": "k"}
    argv = [*model, "--admin-api-key", "z", "--lora-root", str(tmp_path), "--lora-root", "/srv"]
    settings = settings_from_args(argv, env=env)
    assert settings.admin_api_keys == ["z", "x", "y"] and settings.api_keys == ["k"]
    assert settings.auth_keys == ["k", "z", "x", "y"]
    assert settings.lora_roots == [str(tmp_path), "/srv"]
    assert settings_from_args(model, env={}).admin_api_keys == []
    with pytest.raises(SettingsError, match="non-empty"):
        settings_from_args([*model, "--admin-api-key", ""], env={})
    with pytest.raises(SettingsError, match="--lora-root"):
        settings_from_args([*model, "--lora-root", ""], env={})
    with pytest.raises(ModelLoadError, match="--lora-root: no directory"):
        preflight(Settings(model=str(tiny_checkpoint), lora_roots=[str(tmp_path / "missing")]))


def test_an_admin_key_alone_turns_auth_on(tiny_checkpoint: Path) -> None:
    settings = Settings(model=str(tiny_checkpoint), admin_api_keys=[ADMIN])
    with live_server(settings) as server:
        assert complete(server, MODEL_NAME, ADMIN).status_code == 200
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"}, timeout=30)
        assert r.status_code == 401
