"""The playground's browser harness: a real `gptserve serve`, headless Chromium through
playwright, and the HTTP helpers the playground tests check the page against.

Needs Debian's `chromium` at /usr/bin/chromium and the Python `playwright` package (its own
browser download is not used); the tests that use it are skipped without that browser.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, sync_playwright

from tests.server.conftest import free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
KEY = "playground-key"
REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT = 60.0
TIMEOUT_MS = 20_000

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason="browser test needs Debian's chromium at /usr/bin/chromium (apt-get install -y chromium)",
)


@contextmanager
def run_server(
    model_dir: Path, log_path: Path, *extra: str, startup_timeout: float = STARTUP_TIMEOUT
) -> Iterator[str]:
    """`gptserve serve` on a free port; yields its base URL and always stops it."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gptserve.server",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        *extra,
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


@contextmanager
def serve_with_key(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`checkpoint` served with --api-key KEY (a test module's `server_url` fixture)."""
    log = tmp_path_factory.mktemp("playground") / "server.log"
    with run_server(checkpoint, log, "--api-key", KEY) as url:
        yield url


@contextmanager
def chromium() -> Iterator[Browser]:
    """Debian's Chromium, headless (a test module's `browser` fixture)."""
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def open_page(browser: Browser, url: str, tab: str = "", **context_args: object) -> Iterator[Page]:
    """A fresh browser context (no shared storage) on the playground, on `tab` ("": the chat,
    which a user sees first); fails on JavaScript errors."""
    context = browser.new_context(viewport={"width": 1200, "height": 800}, **context_args)
    errors: list[str] = []
    try:
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{url}/#{tab}" if tab else f"{url}/")
        yield page
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read())


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample over the series whose labels include `labels`."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


def wait_until_freed(url: str, disconnected_before: float, timeout: float = 10.0) -> None:
    """Wait until the server runs nothing and has counted one more disconnected request."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        running = metric(url, "gptserve_num_requests_running")
        gone = metric(url, "gptserve_requests_total", status="disconnected")
        if running == 0 and gone > disconnected_before:
            break
        time.sleep(0.1)
    assert running == 0 and gone == disconnected_before + 1
