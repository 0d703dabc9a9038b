"""Real uvicorn servers on 127.0.0.1 over a tiny random GPT-2-shaped checkpoint."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from gptserve.engine.engine import Engine
from gptserve.server.app import create_app
from gptserve.server.runtime import LoadedModel, ServerState, load_model
from gptserve.server.settings import Settings

API_KEY = "test-key-123"
MODEL_NAME = "tiny-gpt"
STARTUP_TIMEOUT = 30.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    app: FastAPI
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> ServerState:
        return self.app.state.server

    @property
    def engine(self) -> Engine:
        return self.state.async_engine.engine

    def wait_blocks_free(self, timeout: float = 5.0) -> bool:
        """True once every KV block is back in the pool (bounded wait)."""
        blocks = self.engine.blocks
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if blocks.num_free_blocks == blocks.num_blocks and self.engine.num_running == 0:
                return True
            time.sleep(0.02)
        return False


def slow_steps(live: LiveServer, delay: float = 0.02) -> None:
    """Make every model step of a live server take `delay` longer, so requests stay running."""
    fast = live.engine.model.forward_cached

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(delay)
        return fast(*args, **kwargs)

    live.engine.model.forward_cached = slow


def wait_until(predicate, timeout: float = 10.0) -> bool:  # noqa: ANN001
    """Poll predicate every 10 ms; True as soon as it holds, False after timeout seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def wait_for_server(
    url: str, proc: subprocess.Popen, timeout: float = 60.0, ready: bool = True
) -> None:
    """Poll `url`/health until it answers 200 (or, with ready=False, answers at all); fails if
    the process exits first or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200 or not ready:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"the server did not answer in {timeout:g} s"
        time.sleep(0.1)


@contextmanager
def live_server(
    settings: Settings,
    loader: Callable[[Settings], LoadedModel] = load_model,
    wait_ready: bool = True,
) -> Iterator[LiveServer]:
    """Serve create_app(settings, loader) from a thread on 127.0.0.1; always shut down.

    It yields once the port answers and, with wait_ready, once the model serves.
    """
    settings.host, settings.port = "127.0.0.1", free_port()
    app = create_app(settings, loader)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    state: ServerState = app.state.server
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while not server.started or (wait_ready and not state.ready):
            if state.load_error and wait_ready:  # without it, a failed load is what is tested
                raise RuntimeError(f"test server failed to load: {state.load_error}")
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("test server did not start")
            time.sleep(0.02)
        yield LiveServer(app, settings.port)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="session")
def server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    """The shared server: auth on, default limits, 8 sequences at a time."""
    settings = Settings(model=str(tiny_checkpoint), api_keys=[API_KEY], max_num_seqs=8)
    with live_server(settings) as live:
        yield live


@pytest.fixture()
def headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """One headless Chromium per playground test module (tests/server/playground_browser.py).

    Module scope, not session: Playwright's sync API keeps an asyncio loop running in this thread
    while it is open, and later modules (test_ray.py) call asyncio.run, which refuses to start then.
    """
    from tests.server.playground_browser import chromium

    with chromium() as browser:
        yield browser
