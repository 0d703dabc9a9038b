"""Faults over real HTTP: a failing model step, a request larger than the KV pool, hung clients,
and per-request timeouts. Each server here slows its model steps down a little so that requests
stay in flight long enough to be interfered with."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from gptserve.kernels.paged_kv import KVPools
from gptserve.server.runtime import LoadedModel, ModelLoadError
from gptserve.server.settings import Settings

from tests.server.conftest import (
    API_KEY,
    MODEL_NAME,
    LiveServer,
    live_server,
    slow_steps,
    wait_until,
)

STEP_DELAY = 0.02  # seconds added to every model step


@contextmanager
def slow_server(settings: Settings) -> Iterator[LiveServer]:
    with live_server(settings) as live:
        slow_steps(live, STEP_DELAY)
        yield live


def sse_data(lines: Iterator[str]) -> list[str]:
    return [line[6:] for line in lines if line.startswith("data: ")]


def long_stream(max_tokens: int = 200, **extra: object) -> dict:
    return {
        "model": MODEL_NAME,
        "prompt": "a",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }


# ---- a model step that raises ----------------------------------------------------------------


@pytest.fixture(scope="module")
def two_seq_server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    """Two sequences at a time: a third request waits outside the running batch."""
    with slow_server(Settings(model=str(tiny_checkpoint), max_num_seqs=2)) as live:
        yield live


def test_failed_step_fails_only_its_requests_and_health_counts_it(
    two_seq_server: LiveServer,
) -> None:
    server = two_seq_server
    engine, async_engine = server.engine, server.app.state.server.async_engine
    url = f"{server.url}/v1/completions"
    failed_before = httpx.get(f"{server.url}/health", timeout=10).json()["failed_steps"]
    model = engine.model
    healthy = model.forward_cached
    armed = threading.Event()

    def fail_once(*args, **kwargs):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected step fault")
        return healthy(*args, **kwargs)

    model.forward_cached = fail_once
    waiting_result: dict = {}

    def waiting_request() -> None:  # queued behind the two running ones: not in the failed step
        r = httpx.post(url, json={"prompt": "c", "max_tokens": 5, "ignore_eos": True}, timeout=60)
        waiting_result["response"] = r

    try:
        with (
            httpx.stream("POST", url, json=long_stream(), timeout=60) as a,
            httpx.stream("POST", url, json=long_stream(), timeout=60) as b,
        ):
            lines_a, lines_b = a.iter_lines(), b.iter_lines()
            for lines in (lines_a, lines_b):  # both are decoding
                assert json.loads(next(x for x in lines if x.startswith("data: "))[6:])["choices"]
            thread = threading.Thread(target=waiting_request)
            thread.start()
            assert wait_until(lambda: async_engine.num_waiting >= 1)
            armed.set()
            rest_a, rest_b = sse_data(lines_a), sse_data(lines_b)
        thread.join(60)
    finally:
        model.forward_cached = healthy
    for rest in (rest_a, rest_b):  # each request of the failed step: one error event, then [DONE]
        assert rest[-1] == "[DONE]"
        err = json.loads(rest[-2])["error"]
        assert err["code"] == "engine_error" and "server log" in err["message"]
        assert "injected step fault" not in err["message"]
        assert all("error" not in json.loads(d) for d in rest[:-2])
    r = waiting_result["response"]  # the waiting request ran afterwards, untouched
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["failed_steps"] == failed_before + 1
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert f"gptserve_engine_failed_steps {float(failed_before + 1)}" in metrics
    assert server.wait_blocks_free()


def test_failed_step_non_streaming_gets_503(two_seq_server: LiveServer) -> None:
    model = two_seq_server.engine.model
    healthy = model.forward_cached

    def broken(*args, **kwargs):
        raise RuntimeError("injected step fault")

    model.forward_cached = broken
    try:
        r = httpx.post(
            f"{two_seq_server.url}/v1/completions",
            json={"prompt": "x", "max_tokens": 3},
            timeout=30,
        )
    finally:
        model.forward_cached = healthy
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "engine_error"
    ok = httpx.post(
        f"{two_seq_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30
    )
    assert ok.status_code == 200
    assert two_seq_server.wait_blocks_free()


# ---- a request larger than the whole KV pool -------------------------------------------------

POOL_BLOCKS = 6  # of 16 tokens: 96 tokens, less than the model's 256-token context


@pytest.fixture(scope="module")
def small_pool_server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    per_block = KVPools.bytes_per_block(2, 4, 16, 16, torch.float32)
    settings = Settings(
        model=str(tiny_checkpoint), kv_cache_gb=(POOL_BLOCKS + 0.5) * per_block / 2**30
    )
    with live_server(settings) as live:
        assert live.engine.blocks.num_blocks == POOL_BLOCKS
        yield live


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [1] * 10, "max_tokens": 100}, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 10, "max_tokens": 100, "stream": True}, "max_tokens"),
        ("/v1/completions", {"prompt": [1] * 120, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 120}, "max_tokens"),
    ],
)  # fmt: skip
def test_request_larger_than_the_pool_is_a_clear_400(
    small_pool_server: LiveServer, path: str, body: dict, param: str
) -> None:
    r = httpx.post(small_pool_server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == "kv_cache_exceeded"
    assert f"pool has {POOL_BLOCKS}" in err["message"]


def test_requests_that_fit_the_small_pool_run(small_pool_server: LiveServer) -> None:
    url = small_pool_server.url
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1] * 10, "max_tokens": 80}, timeout=60)
    assert r.status_code == 200, r.text
    # chat without max_tokens: the default is bounded by the pool, not only by the context
    chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["total_tokens"] <= POOL_BLOCKS * 16
    assert small_pool_server.wait_blocks_free()


def metric_value(text: str, name: str) -> float:
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def test_preemptions_are_counted_in_metrics_and_logged(
    small_pool_server: LiveServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Three requests of 70 tokens (5 blocks each) in a 6-block pool: they are admitted
    together, then run out of blocks; the newest are preempted and recomputed, all finish."""
    url = small_pool_server.url
    before = metric_value(
        httpx.get(f"{url}/metrics", timeout=10).text, "gptserve_preemptions_total"
    )
    body = {"prompt": [1] * 10, "max_tokens": 60, "ignore_eos": True, "temperature": 0}
    with caplog.at_level(logging.INFO, logger="gptserve.engine.engine"):
        with ThreadPoolExecutor(3) as pool:
            answers = list(
                pool.map(
                    lambda _: httpx.post(f"{url}/v1/completions", json=body, timeout=120), range(3)
                )
            )
    assert [r.status_code for r in answers] == [200] * 3
    texts = {r.json()["choices"][0]["text"] for r in answers}
    assert len(texts) == 1  # recomputed sequences continue exactly as the others
    assert all(r.json()["usage"]["completion_tokens"] == 60 for r in answers)
    after = metric_value(httpx.get(f"{url}/metrics", timeout=10).text, "gptserve_preemptions_total")
    logged = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert after > before
    assert logged and "for lack of KV cache blocks" in logged[0]
    counted = sum(int(m.split()[1]) for m in logged)
    assert counted == after - before
    assert small_pool_server.wait_blocks_free()


# ---- clients that hang -----------------------------------------------------------------------


def open_hung_client(port: int, mode: str) -> socket.socket:
    """A raw connection that sends a streaming request and then never reads (or never finishes
    sending its body). A small receive buffer makes the server's writes back up quickly."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(long_stream(250, n=8, logprobs=20)).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock.sendall(head + (body if mode == "never-reads" else body[: len(body) // 2]))
    return sock


@pytest.mark.parametrize("mode", ["never-reads", "never-sends-body"])
def test_hung_client_does_not_block_others(server: LiveServer, headers: dict, mode: str) -> None:
    hung = [open_hung_client(server.port, mode) for _ in range(2)]
    try:
        if mode == "never-reads":  # its sequences are in the engine, their output backs up
            assert wait_until(lambda: server.engine.num_running >= 1)
        t0 = time.monotonic()

        def one(i: int) -> int:
            body = {
                "prompt": f"client {i}",
                "max_tokens": 8,
                "ignore_eos": True,
                "stream": bool(i % 2),
            }
            r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
            return r.status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(one, range(4)))
        elapsed = time.monotonic() - t0
        assert statuses == [200] * 4
        assert elapsed < 20, f"other clients took {elapsed:.1f}s"
        health = httpx.get(f"{server.url}/health", timeout=5)
        assert health.status_code == 200
    finally:
        for sock in hung:
            sock.close()
    assert server.wait_blocks_free(timeout=30)


# ---- per-request timeout ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def timeout_server(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    settings = Settings(model=str(tiny_checkpoint), request_timeout=1.0, body_timeout=1.0)
    with slow_server(settings) as live:
        yield live


def test_a_streaming_request_past_the_timeout_ends_with_what_it_generated(
    timeout_server: LiveServer,
) -> None:
    t0 = time.monotonic()
    body = {**long_stream(250), "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{timeout_server.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        data = sse_data(r.iter_lines())
    elapsed = time.monotonic() - t0
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert not any("error" in c for c in chunks)
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    generated = chunks[-1]["usage"]["completion_tokens"]
    assert 0 < generated < 250  # tokens were streamed before the deadline, then it was cut
    assert 1.0 <= elapsed < 10
    assert timeout_server.wait_blocks_free()


def test_a_whole_request_past_the_timeout_answers_what_it_generated(
    timeout_server: LiveServer,
) -> None:
    body = {**long_stream(250), "stream": False}
    t0 = time.monotonic()
    r = httpx.post(f"{timeout_server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert 1.0 <= time.monotonic() - t0 < 10
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert 0 < r.json()["usage"]["completion_tokens"] < 250
    assert timeout_server.wait_blocks_free()
    quick = httpx.post(
        f"{timeout_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert quick.status_code == 200


def test_a_body_that_stops_arriving_gets_408_and_frees_its_slot(timeout_server: LiveServer) -> None:
    sock = open_hung_client(timeout_server.port, "never-sends-body")
    try:
        sock.settimeout(10)
        t0 = time.monotonic()
        reply = b""
        while b"}}" not in reply:
            chunk = sock.recv(4096)
            if not chunk:
                break
            reply += chunk
        elapsed = time.monotonic() - t0
    finally:
        sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    err = json.loads(payload)["error"]
    assert err["code"] == "body_timeout" and err["type"] == "invalid_request_error"
    assert "1 seconds" in err["message"]
    assert 0.9 <= elapsed < 8
    quick = httpx.post(
        f"{timeout_server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30
    )
    assert quick.status_code == 200


# ---- a checkpoint that fails to load ---------------------------------------------------------


def test_a_checkpoint_that_fails_to_load_is_reported_by_health_and_the_api(
    tiny_checkpoint: Path,
) -> None:
    def broken(settings: Settings) -> LoadedModel:
        raise ModelLoadError("model.safetensors is unreadable or truncated")

    settings = Settings(model=str(tiny_checkpoint))
    with live_server(settings, loader=broken, wait_ready=False) as live:
        assert wait_until(lambda: live.state.load_error is not None)
        health = httpx.get(f"{live.url}/health", timeout=10)
        assert health.status_code == 503
        assert health.json() == {
            "status": "failed", "error": "the model failed to load",
        }  # fmt: skip
        r = httpx.post(f"{live.url}/v1/completions", json={"prompt": "a"}, timeout=10)
        assert r.status_code == 503
        err = r.json()["error"]
        assert err["code"] == "model_load_failed" and "truncated" in err["message"]
