"""Raw SSE framing, disconnects freeing KV blocks, and many concurrent streams."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx

from tests.server.conftest import MODEL_NAME, LiveServer


def sse_events(lines: list[str]) -> list[str]:
    """The `data:` payloads of a stream; asserts the framing (blank line after each event)."""
    payloads = []
    for i, line in enumerate(lines):
        if line.startswith("data: "):
            payloads.append(line[len("data: ") :])
            assert lines[i + 1] == "", "each event ends with a blank line"
        else:
            assert line == "", f"unexpected line {line!r}"
    return payloads


def test_sse_framing(server: LiveServer, headers: dict) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    payloads = sse_events(raw.split("\n")[:-1])
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_error_event_after_start(server: LiveServer, headers: dict) -> None:
    """A model step that raises: one error event, then [DONE]; the engine keeps serving."""
    engine = server.engine
    original = engine.model.forward_cached
    failed = threading.Event()

    def broken(*args, **kwargs):
        failed.set()
        raise RuntimeError("injected fault")

    body = {
        "model": MODEL_NAME,
        "prompt": "Hi",
        "max_tokens": 50,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"]
        engine.model.forward_cached = broken
        try:
            rest = [line for line in lines if line.startswith("data: ")]
        finally:
            engine.model.forward_cached = original
    assert failed.is_set()
    assert rest[-1] == "data: [DONE]"
    err = json.loads(rest[-2][6:])["error"]
    assert err["type"] == "server_error" and "server log" in err["message"]
    assert "injected fault" not in err["message"]  # the cause may speak of other requests
    health = httpx.get(f"{server.url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["failed_steps"] >= 1
    ok = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 2},
        headers=headers,
        timeout=30,
    )
    assert ok.status_code == 200
    assert server.wait_blocks_free()


def test_midstream_disconnect_frees_blocks(server: LiveServer, headers: dict) -> None:
    assert server.wait_blocks_free()
    body = {
        "model": MODEL_NAME,
        "prompt": "Hi",
        "max_tokens": 240,
        "stream": True,
        "ignore_eos": True,
        "n": 2,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: ")
            if seen == 3:
                break
        assert server.engine.blocks.num_free_blocks < server.engine.blocks.num_blocks
    # the context manager closed the connection mid-stream
    assert server.wait_blocks_free(timeout=5)


def test_nonstream_disconnect_frees_blocks(server: LiveServer, headers: dict) -> None:
    assert server.wait_blocks_free()
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 240, "ignore_eos": True}
    try:
        httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=0.3)
    except httpx.TimeoutException:
        pass
    time.sleep(0.05)
    assert server.wait_blocks_free(timeout=5)


def test_32_concurrent_streams(server: LiveServer, headers: dict) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, int, str]:
        want = 8 + i % 5
        body = {"model": MODEL_NAME, "prompt": f"Client {i} says", "max_tokens": want, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}, "temperature": 0.7}  # fmt: skip
        usage, finish = None, None
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    finish = chunk["choices"][0]["finish_reason"]
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
        return want, usage, finish

    async def run() -> list:
        async with httpx.AsyncClient(base_url=server.url, headers=headers, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), 120)

    results = asyncio.run(run())
    assert all(usage == want and finish == "length" for want, usage, finish in results), results
    assert server.wait_blocks_free()


def test_health_metrics_tokenize(server: LiveServer, headers: dict) -> None:
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["model"] == MODEL_NAME
    tok = httpx.post(
        f"{server.url}/tokenize", json={"prompt": "Hello world"}, headers=headers, timeout=10
    ).json()
    assert tok == {"tokens": [15496, 995], "count": 2, "max_model_len": 256}
    detok = httpx.post(
        f"{server.url}/detokenize", json={"tokens": [15496, 995]}, headers=headers, timeout=10
    )
    assert detok.json() == {"prompt": "Hello world"}
    httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": "x", "max_tokens": 3, "ignore_eos": True},
        headers=headers,
        timeout=30,
    )
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    for name in (
        "gptserve_time_to_first_token_seconds_bucket", "gptserve_inter_token_latency_seconds_bucket",
        "gptserve_e2e_request_latency_seconds_count", "gptserve_num_requests_running",
        "gptserve_num_requests_waiting", "gptserve_kv_cache_usage_ratio", "gptserve_prompt_tokens_total",
        "gptserve_generation_tokens_total", "gptserve_engine_step_seconds_count",
        "gptserve_preemptions_total", "gptserve_engine_failed_steps",
        'gptserve_requests_total{endpoint="completion",finish_reason="length",status="200"}',
    ):  # fmt: skip
        assert name in text, name


def _stream_chunks(server: LiveServer, headers: dict, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=30
    ) as r:
        assert r.status_code == 200
        payloads = sse_events(r.read().decode().split("\n")[:-1])
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_stream_interval_sends_the_first_token_then_every_nth(
    server: LiveServer, headers: dict, monkeypatch
) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 8, "ignore_eos": True,
            "temperature": 0, "logprobs": 1, "n": 2}  # fmt: skip
    whole = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
    monkeypatch.setattr(server.state.settings, "stream_interval", 3)
    chunks = _stream_chunks(server, headers, {**body, "stream": True})
    for index, expected in enumerate(whole.json()["choices"]):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        # 8 tokens: the first at once, then 3, 3 and the last 1 with the finish reason
        assert [len(c["logprobs"]["tokens"]) for c in mine] == [1, 3, 3, 1]
        assert [c["finish_reason"] for c in mine] == [None, None, None, "length"]
        assert "".join(c["text"] for c in mine) == expected["text"]
        tokens = [t for c in mine for t in c["logprobs"]["tokens"]]
        assert tokens == expected["logprobs"]["tokens"]
