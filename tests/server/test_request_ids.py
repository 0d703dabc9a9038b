"""X-Request-Id on every response and in every log line about the request; --log-format json."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
import threading
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from gptserve.server.logging_setup import JsonFormatter, TextFormatter
from gptserve.server.request_ids import (
    RequestIdFilter,
    bind_engine_request,
    current_request_id,
    install,
    unbind_engine_request,
)
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from tests.server.conftest import MODEL_NAME, LiveServer, free_port, wait_for_server, wait_until

REPO = Path(__file__).resolve().parents[2]
MADE = re.compile(r"[0-9a-f]{32}")  # a fresh id: uuid4 hex
# ignore_eos: each ends with finish_reason "length", whatever the random model draws
COMPLETION = (
    "/v1/completions",
    {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "ignore_eos": True},
)
CHAT = (
    "/v1/chat/completions",
    {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
     "ignore_eos": True},
)  # fmt: skip


def call(server: LiveServer, kind: str, headers: dict) -> httpx.Response:
    """One request that ends with the status `kind` names (a stream reads to its end)."""
    if kind == "200":
        path, body = COMPLETION
        return httpx.post(server.url + path, json=body, headers=headers, timeout=60)
    if kind == "401":
        headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
        return httpx.post(server.url + COMPLETION[0], json=COMPLETION[1], headers=headers)
    if kind == "404":
        return httpx.get(server.url + "/v1/no-such-path", headers=headers, timeout=10)
    if kind == "413":
        body = b" " * (server.state.settings.max_body_bytes + 1)
        return httpx.post(server.url + COMPLETION[0], content=body, headers=headers, timeout=10)
    assert kind == "stream"
    path, body = CHAT
    with httpx.stream(
        "POST", server.url + path, json={**body, "stream": True}, headers=headers, timeout=60
    ) as r:
        r.read()
        assert r.text.rstrip().endswith("data: [DONE]")
        return r


STATUS = {"200": 200, "401": 401, "404": 404, "413": 413, "stream": 200}


@pytest.mark.parametrize("kind", list(STATUS))
def test_the_header_is_echoed_when_sent_and_made_when_not(
    server: LiveServer, headers: dict, kind: str
) -> None:
    sent = call(server, kind, {**headers, "X-Request-Id": f"client-{kind}:1.a_b"})
    assert sent.status_code == STATUS[kind], sent.text
    assert sent.headers.get_list("x-request-id") == [f"client-{kind}:1.a_b"]
    made = [call(server, kind, headers) for _ in range(2)]
    assert all(r.status_code == STATUS[kind] for r in made)
    ids = [r.headers["x-request-id"] for r in made]
    assert all(MADE.fullmatch(i) for i in ids) and ids[0] != ids[1]


def test_the_body_id_carries_the_request_id(server: LiveServer, headers: dict) -> None:
    """OpenAI's prefix, the request's id, and a part of its own (one id sent twice at once still
    makes two engine requests)."""
    first = call(server, "200", {**headers, "X-Request-Id": "mine"})
    again = call(server, "200", {**headers, "X-Request-Id": "mine"})
    assert first.headers["x-request-id"] == "mine"
    assert re.fullmatch(r"cmpl-mine-[0-9a-f]{8}", first.json()["id"]), first.json()["id"]
    assert first.json()["id"] != again.json()["id"]


@pytest.mark.parametrize(
    "value", ["bad id!", "x" * 129, "a/b", 'quote"d', "ünïcode", "tab\there", ""]
)
def test_an_invalid_header_is_replaced_by_a_fresh_id(
    server: LiveServer, headers: dict, value: str
) -> None:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    r = httpx.get(
        f"{server.url}/health", headers=[*raw, (b"x-request-id", value.encode())], timeout=10
    )
    assert MADE.fullmatch(r.headers["x-request-id"]), r.headers


def test_the_longest_valid_id_is_kept(server: LiveServer) -> None:
    longest = "A1._:-" * 21 + "zz"  # 128 characters
    assert len(longest) == 128
    r = httpx.get(f"{server.url}/health", headers={"X-Request-Id": longest}, timeout=10)
    assert r.headers["x-request-id"] == longest


def test_a_500_and_the_app_s_own_headers_carry_it_once() -> None:
    """Starlette's outermost error middleware answers a 500; the id goes around it too, and a
    header of the same name the app set is replaced, not doubled."""

    async def boom(request: object) -> None:
        raise RuntimeError("a bug")

    async def own(request: object) -> PlainTextResponse:
        return PlainTextResponse("ok", headers={"X-Request-Id": "the-app-s"})

    app = Starlette(routes=[Route("/boom", boom), Route("/own", own)])
    install(app)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.get("/boom", headers={"X-Request-Id": "req-500"})
        assert r.status_code == 500 and r.headers.get_list("x-request-id") == ["req-500"]
        r = client.get("/own", headers={"X-Request-Id": "req-own"})
        assert r.headers.get_list("x-request-id") == ["req-own"]


def test_log_records_of_a_request_carry_its_id(
    server: LiveServer, headers: dict, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.handler.addFilter(RequestIdFilter())  # as logging_setup installs it on its handler
    path, body = CHAT
    with caplog.at_level(logging.INFO, logger="gptserve.server"):
        r = httpx.post(
            server.url + path,
            json={**body, "not_a_field": 1},  # logs the ignored-fields warning
            headers={**headers, "X-Request-Id": "follow-me"},
            timeout=60,
        )
        assert r.status_code == 200, r.text

        def finished() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.getMessage().startswith("finished chat")]

        assert wait_until(lambda: finished(), timeout=10)
    warning = [r for r in caplog.records if "were present in the request but ignored" in r.msg]
    assert [w.request_id for w in warning] == ["follow-me"]
    (line,) = finished()
    assert line.request_id == "follow-me" and line.levelno == logging.INFO
    usage = r.json()["usage"]
    assert line.response_id == r.json()["id"] and line.model == MODEL_NAME
    assert (line.prompt_tokens, line.completion_tokens) == (
        usage["prompt_tokens"], usage["completion_tokens"],
    )  # fmt: skip
    assert line.status == 200 and line.endpoint == "chat" and line.finish_reason == "length"
    assert 0 <= line.queue_s <= line.ttft_s <= line.total_s
    other = [r for r in caplog.records if getattr(r, "request_id", None) not in (None, "follow-me")]
    assert other == []  # no line carries another request's id


def test_the_engine_thread_s_lines_about_a_request_carry_its_id() -> None:
    """The engine names its request (extra engine_request_id: the server's id and the prompt's
    index); while the request runs, the filter maps that to the request's X-Request-Id."""
    filt, seen = RequestIdFilter(), []

    def engine_thread_logs() -> None:
        for engine_id in ("chatcmpl-abc-0", "chatcmpl-abc-1", "chatcmpl-other-0"):
            record = logging.makeLogRecord({"msg": "failed", "engine_request_id": engine_id})
            filt.filter(record)
            seen.append(record.request_id)

    token = current_request_id.set("req-42")
    try:
        bind_engine_request("chatcmpl-abc")
        thread = threading.Thread(target=engine_thread_logs)  # no request context there
        thread.start()
        thread.join()
        unbind_engine_request("chatcmpl-abc")
    finally:
        current_request_id.reset(token)
    assert seen == ["req-42", "req-42", None]
    record = logging.makeLogRecord({"msg": "later", "engine_request_id": "chatcmpl-abc-0"})
    filt.filter(record)
    assert record.request_id is None  # forgotten once the request ended


def test_text_lines_are_as_before_with_the_id_when_there_is_one() -> None:
    fmt = TextFormatter()
    plain = logging.makeLogRecord({"name": "gptserve.x", "levelname": "INFO", "msg": "hello"})
    plain.request_id = None
    assert re.fullmatch(r"\S+ \S+ INFO gptserve\.x: hello", fmt.format(plain))
    ours = logging.makeLogRecord({"name": "gptserve.x", "levelname": "INFO", "msg": "hi"})
    ours.request_id = "r-1"
    assert re.fullmatch(r"\S+ \S+ INFO gptserve\.x \[r-1\]: hi", fmt.format(ours))


def test_json_lines_carry_extra_fields_and_tracebacks() -> None:
    try:
        raise ValueError("bad")
    except ValueError:
        record = logging.makeLogRecord(
            {"name": "n", "levelname": "ERROR", "msg": "x %d", "args": (1,),
             "exc_info": sys.exc_info(), "model": "m", "path": Path("/p")}
        )  # fmt: skip
    record.request_id = "r"
    line = json.loads(JsonFormatter().format(record))
    assert {k: line[k] for k in ("level", "logger", "message", "request_id", "model")} == {
        "level": "ERROR", "logger": "n", "message": "x 1", "request_id": "r", "model": "m",
    }  # fmt: skip
    assert line["path"] == "/p" and "ValueError: bad" in line["exception"]
    assert datetime.fromisoformat(line["time"]).tzinfo is not None


def test_log_format_json_lines_parse_with_a_finished_request_s_fields(
    tiny_checkpoint: Path,
) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptserve.server", "--model", str(tiny_checkpoint), "--port",
         str(port), "--log-format", "json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, proc)
        path, body = CHAT
        r = httpx.post(
            url + path, json={**body, "max_tokens": 3, "temperature": 0},
            headers={"X-Request-Id": "json-line-1"}, timeout=60,
        )  # fmt: skip
        assert r.status_code == 200 and r.headers["x-request-id"] == "json-line-1"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    lines = [json.loads(line) for line in err.splitlines() if line.strip()]  # each one JSON
    assert all({"time", "level", "logger", "message"} <= set(line) for line in lines)
    for line in lines:
        datetime.fromisoformat(line["time"])
    assert any(line["logger"].startswith("uvicorn") for line in lines)  # its lines too
    assert not [line for line in lines if "color_message" in line]  # not its coloured copy
    (done,) = [line for line in lines if line["message"].startswith("finished ")]
    usage = r.json()["usage"]
    assert done["level"] == "INFO" and done["request_id"] == "json-line-1"
    assert {k: done[k] for k in ("model", "endpoint", "status", "finish_reason")} == {
        "model": tiny_checkpoint.name, "endpoint": "chat", "status": 200, "finish_reason": "length"
    }  # fmt: skip
    assert done["prompt_tokens"] == usage["prompt_tokens"]
    assert done["completion_tokens"] == usage["completion_tokens"] == 3
    assert 0 < done["ttft_s"] <= done["total_s"] and done["response_id"] == r.json()["id"]
    assert not [line for line in lines if line.get("request_id") not in (None, "json-line-1")]
