"""Fail closed: a loopback-bound server answers only loopback Host headers (DNS rebinding), and a
server bound elsewhere without an API key says so when it starts."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from gptserve.server.hosts import host_allowed, host_name, is_loopback
from gptserve.server.settings import Settings

from tests.conftest import REPO
from tests.server.conftest import free_port, live_server, wait_for_server


@pytest.mark.parametrize(
    "header, bind, allowed, answered",
    [
        ("127.0.0.1:8000", "127.0.0.1", [], True),
        ("localhost:8000", "127.0.0.1", [], True),
        ("[::1]:8000", "127.0.0.1", [], True),
        ("app.localhost", "::1", [], True),
        ("127.8.9.10", "localhost", [], True),
        ("attacker.example:8000", "127.0.0.1", [], False),
        ("127.0.0.1.attacker.example", "127.0.0.1", [], False),
        ("10.0.0.5:8000", "127.0.0.1", [], False),
        ("Proxy.Example", "127.0.0.1", ["proxy.example"], True),
        ("anything.example", "127.0.0.1", ["*"], True),
        ("attacker.example", "0.0.0.0", [], True),  # bound to be reached by name
        (None, "127.0.0.1", [], True),
    ],
)
def test_which_hosts_are_answered(header, bind, allowed, answered) -> None:
    assert host_allowed(header, bind, allowed) is answered


def test_host_names_and_loopback() -> None:
    assert (
        host_name("[::1]:80") == "::1"
        and host_name("a.b:80") == "a.b"
        and host_name("::1") == "::1"
    )
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.com")


def test_a_rebound_name_is_refused_and_a_loopback_name_answered(tiny_checkpoint: Path) -> None:
    with live_server(Settings(model=str(tiny_checkpoint))) as live:
        ok = httpx.get(f"{live.url}/v1/models", timeout=10)
        assert ok.status_code == 200
        for path in ("/v1/models", "/health", "/"):
            r = httpx.get(f"{live.url}{path}", headers={"Host": "rebound.example:8000"}, timeout=10)
            assert r.status_code == 403, path
            assert r.json()["error"]["code"] == "host_not_allowed"
        body = {"prompt": "a", "max_tokens": 2}
        r = httpx.post(
            f"{live.url}/v1/completions", json=body, headers={"Host": "evil.test"}, timeout=10
        )
        assert r.status_code == 403
    settings = Settings(model=str(tiny_checkpoint), allowed_hosts=["proxy.example"])
    with live_server(settings) as live:
        r = httpx.get(f"{live.url}/v1/models", headers={"Host": "proxy.example"}, timeout=10)
        assert r.status_code == 200


@pytest.mark.timeout(120)
def test_an_open_non_loopback_bind_warns_at_start(tiny_checkpoint: Path) -> None:
    port = free_port()
    args = [sys.executable, "-m", "gptserve.server", "--model", str(tiny_checkpoint), "--host", "0.0.0.0",
            "--port", str(port), "--shutdown-grace", "1"]  # fmt: skip
    proc = subprocess.Popen(args, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_server(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    warning = [line for line in err.splitlines() if "WARNING" in line and "API key" in line]
    assert len(warning) == 1 and "binding 0.0.0.0 with no API key" in warning[0], err
    # the startup log says how long the imports, the load and the whole start took
    assert re.search(r"listening on http://0\.0\.0\.0:\d+ [\d.]+ s after start \(the imports\)", err), err  # fmt: skip
    assert re.search(r"ready [\d.]+ s after start: the model loaded in [\d.]+ s", err), err
