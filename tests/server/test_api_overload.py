"""A full waiting queue answers 429 with Retry-After, and the server recovers afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from gptserve.server.settings import Settings

from tests.server.conftest import MODEL_NAME, LiveServer, live_server, slow_steps, wait_until


@pytest.fixture(scope="module")
def small_server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(Settings(model=str(tiny_checkpoint), max_num_seqs=1, max_queue=1)) as live:
        slow_steps(live)  # ~20 ms a step, so a long request stays running for a while
        yield live


def test_queue_full_then_recovers(small_server: LiveServer) -> None:
    url = f"{small_server.url}/v1/completions"
    long = {
        "model": MODEL_NAME,
        "prompt": "a",
        "max_tokens": 250,
        "ignore_eos": True,
        "stream": True,
    }
    async_engine = small_server.app.state.server.async_engine
    with httpx.stream("POST", url, json=long, timeout=30) as running:
        lines = running.iter_lines()  # keep a reference: dropping it would close the connection
        next(lines)
        with httpx.stream("POST", url, json=long, timeout=30) as waiting:
            assert waiting.status_code == 200
            assert wait_until(lambda: async_engine.num_waiting >= 1)
            r = httpx.post(url, json={"prompt": "b", "max_tokens": 1}, timeout=30)
            assert r.status_code == 429
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
            client = openai.OpenAI(
                base_url=f"{small_server.url}/v1", api_key="none", max_retries=0, timeout=10
            )
            with pytest.raises(openai.RateLimitError):
                client.completions.create(model=MODEL_NAME, prompt="c", max_tokens=1)
    assert small_server.wait_blocks_free()
    assert wait_until(lambda: async_engine.num_waiting == 0)
    r = httpx.post(url, json={"prompt": "b", "max_tokens": 3, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_one_keys_full_queue_does_not_turn_another_key_away(tiny_checkpoint: Path) -> None:
    """With API keys each key has its own --max-queue: key a's backlog is a's 429, not b's."""
    settings = Settings(
        model=str(tiny_checkpoint), api_keys=["a", "b"], max_num_seqs=1, max_queue=1
    )
    with live_server(settings) as live:
        slow_steps(live)
        url = f"{live.url}/v1/completions"
        long = {"prompt": "a", "max_tokens": 250, "ignore_eos": True, "stream": True}
        engine = live.app.state.server.async_engine.engine
        as_a, as_b = {"Authorization": "Bearer a"}, {"Authorization": "Bearer b"}
        with httpx.stream("POST", url, json=long, headers=as_a, timeout=30) as running:
            lines = running.iter_lines()
            next(lines)
            with httpx.stream("POST", url, json=long, headers=as_a, timeout=30) as waiting:
                assert waiting.status_code == 200
                assert wait_until(lambda: engine.num_waiting >= 1)
                r = httpx.post(url, json={"prompt": "b", "max_tokens": 1}, headers=as_a)
                assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
                short = {"prompt": "b", "max_tokens": 2, "ignore_eos": True}
                r = httpx.post(url, json=short, headers=as_b, timeout=30)
                assert r.status_code == 200, r.text  # admitted ahead of a's waiting request
        assert live.wait_blocks_free()
