"""Prefix cache isolation over HTTP: what `cached_tokens` tells a client about other clients'
prompts under each --prefix-cache-scope, with and without `cache_salt`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from gptserve.model.tokenizers import get_tokenizer
from gptserve.server.settings import Settings, SettingsError, settings_from_args
from gptserve.server.tenancy import key_tenant, request_cache_salt

from tests.server.conftest import LiveServer, live_server

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"


def prompt(tag: str) -> str:
    """About 70 GPT-2 tokens, distinct for each tag: four full 16-token blocks and a partial one."""
    return " ".join([tag] + [f"w{i}" for i in range(34)])


def all_but_one(text: str) -> int:
    """A completions prompt's cached tokens when all of it is cached: its last one is computed."""
    return len(get_tokenizer().encode(text)) - 1


def cached(live: LiveServer, key: str | None, text: str, chat: bool = False, **extra) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if chat:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}
    else:
        path, body = "/v1/completions", {"prompt": text}
    body = {**body, "max_tokens": 2, "temperature": 0, **extra}
    r = httpx.post(live.url + path, json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def keyed(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    settings = Settings(model=str(tiny_checkpoint), api_keys=[KEY_A, KEY_B], max_num_seqs=4)
    with live_server(settings) as live:
        yield live


@pytest.fixture(scope="module")
def shared(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    settings = Settings(
        model=str(tiny_checkpoint), api_keys=[KEY_A, KEY_B], max_num_seqs=4,
        prefix_cache_scope="global",
    )  # fmt: skip
    with live_server(settings) as live:
        yield live


@pytest.fixture(scope="module")
def open_server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(Settings(model=str(tiny_checkpoint), max_num_seqs=4)) as live:
        yield live


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_second_key_probing_the_first_keys_prompt_finds_nothing_cached(
    keyed: LiveServer, chat: bool
) -> None:
    text = prompt(f"probe-{chat}")
    assert cached(keyed, KEY_A, text, chat) == 0
    assert cached(keyed, KEY_B, text, chat) == 0  # B learns nothing of A's prompt
    assert cached(keyed, KEY_A, text, chat) > 60  # A still reuses its own
    assert cached(keyed, KEY_B, text, chat) > 60  # and B its own, computed by its probe


def test_cache_salt_separates_callers_that_share_a_key(keyed: LiveServer) -> None:
    text = prompt("salted")
    assert cached(keyed, KEY_A, text, cache_salt="alice") == 0
    assert cached(keyed, KEY_A, text, cache_salt="bob") == 0
    assert cached(keyed, KEY_A, text) == 0  # the key's unsalted requests are a caller too
    assert cached(keyed, KEY_A, text, cache_salt="alice") == all_but_one(text)
    assert cached(keyed, KEY_B, text, cache_salt="alice") == 0  # a salt is per key


def test_global_scope_shares_across_keys_and_cache_salt_still_separates(
    shared: LiveServer,
) -> None:
    text = prompt("global")
    assert cached(shared, KEY_A, text) == 0
    assert cached(shared, KEY_B, text) == all_but_one(text)
    assert cached(shared, KEY_B, text, cache_salt="private") == 0
    assert cached(shared, KEY_A, text, cache_salt="private") == all_but_one(
        text
    )  # same salt: shared again


def test_without_keys_everyone_shares_unless_they_salt(open_server: LiveServer) -> None:
    text = prompt("open")
    assert cached(open_server, None, text) == 0
    assert cached(open_server, None, text) == all_but_one(text)
    assert cached(open_server, None, text, cache_salt="mine") == 0
    assert cached(open_server, None, text, cache_salt="yours") == 0
    assert cached(open_server, None, text, cache_salt="mine") == all_but_one(text)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("salt", ["", 7, None])
def test_a_bad_cache_salt_is_a_400_naming_it(open_server: LiveServer, path: str, salt) -> None:
    body = {"prompt": "x", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    r = httpx.post(open_server.url + path, json={**body, "cache_salt": salt}, timeout=30)
    if salt is None:  # null is "no salt"
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_the_salt_depends_on_scope_tenant_and_request_salt() -> None:
    a, b = key_tenant(KEY_A.encode()), key_tenant(KEY_B.encode())
    assert a != b and KEY_A not in a
    assert request_cache_salt("key", None, None) is None
    assert request_cache_salt("global", a, None) is None
    salts = {
        request_cache_salt(scope, tenant, salt)
        for scope, tenant, salt in [
            ("key", a, None), ("key", b, None), ("key", a, "s"), ("key", None, "s"),
            ("key", "x", "y|z"), ("key", "x|y", "z"),
        ]
    }  # fmt: skip
    assert len(salts) == 6
    assert request_cache_salt("global", a, "s") == request_cache_salt("global", b, "s")


def test_the_scope_flag_parses() -> None:
    assert settings_from_args([]).prefix_cache_scope == "key"
    assert settings_from_args(["--prefix-cache-scope", "global"]).prefix_cache_scope == "global"
    with pytest.raises(SystemExit):
        settings_from_args(["--prefix-cache-scope", "everyone"])
    with pytest.raises(SettingsError):
        Settings(max_consecutive_failed_steps=0).validate()
