"""A sick replica says so: engine steps that keep failing turn /health and every new request into
503 `engine_unhealthy` (and, with --exit-on-engine-failure, end the process), while a fault that
passes fails only its own requests and the server keeps serving."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from gptserve.model.gpt import GPT
from gptserve.server.settings import Settings, settings_from_args

from tests.server.conftest import free_port, live_server, wait_for_server, wait_until

REPO = Path(__file__).resolve().parents[2]
BODY = {"prompt": "x", "max_tokens": 3}


@contextmanager
def failing_steps(model: GPT, fails: Callable[[], bool]) -> Iterator[None]:
    """Every model step raises while fails() is true."""
    healthy = model.forward_cached

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if fails():
            raise RuntimeError("injected step fault")
        return healthy(*args, **kwargs)

    model.forward_cached = forward
    try:
        yield
    finally:
        model.forward_cached = healthy


def post(url: str, path: str = "/v1/completions", **extra) -> httpx.Response:
    return httpx.post(url + path, json={**BODY, **extra}, timeout=30)


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def test_steps_that_keep_failing_make_health_and_requests_503(tiny_checkpoint: Path) -> None:
    settings = Settings(model=str(tiny_checkpoint), max_consecutive_failed_steps=3)
    with live_server(settings) as live:
        with failing_steps(live.engine.model, lambda: True):  # a sticky fault
            for i in range(3):
                assert httpx.get(live.url + "/health", timeout=10).status_code == 200, i
                assert_error(post(live.url), 503, "engine_error")  # its own step failed
            health = httpx.get(live.url + "/health", timeout=10)
            assert_error(health, 503, "engine_unhealthy")
            body = health.json()
            assert body["status"] == "unhealthy" and body["failed_steps"] == 3
            assert "the last 3 engine steps in a row failed" in body["error"]["message"]
            assert "injected step fault" not in health.text  # /health needs no key
            assert "server log" in body["error"]["message"]
            # new work is refused before it reaches the engine, on every generating route
            err = assert_error(post(live.url), 503, "engine_unhealthy")
            assert "injected step fault" not in err["message"]
            chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
            assert_error(post(live.url, "/v1/chat/completions", **chat), 503, "engine_unhealthy")
        assert live.engine.num_failed_steps == 3  # nothing else reached the model
        # it stays unhealthy: the fault was sticky, the replica is to be replaced
        assert httpx.get(live.url + "/health", timeout=10).status_code == 503
        assert_error(post(live.url), 503, "engine_unhealthy")
        assert live.wait_blocks_free()


def test_requests_the_engine_holds_when_it_gives_up_end_with_an_error(
    tiny_checkpoint: Path,
) -> None:
    """The stream whose step failed, and a request still waiting outside that step, each end
    with an error rather than hang: the engine fails everything it holds when it gives up."""
    settings = Settings(model=str(tiny_checkpoint), max_consecutive_failed_steps=1, max_num_seqs=1)
    with live_server(settings) as live:
        fail = {"on": False}
        with ThreadPoolExecutor(1) as pool, failing_steps(live.engine.model, lambda: fail["on"]):
            body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()
                first = next(line for line in lines if line.startswith("data: {"))
                assert json.loads(first[6:])["choices"]
                waiting = pool.submit(post, live.url)  # behind the stream: max_num_seqs=1
                assert wait_until(lambda: live.state.async_engine.num_waiting >= 1)
                fail["on"] = True
                rest = [line[6:] for line in lines if line.startswith("data: ")]
            err = assert_error(waiting.result(30), 503, "engine_error")
        assert "the last engine step failed" in err["message"]
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["error"]["code"] == "engine_error"
        assert live.engine.num_failed_steps == 1  # the waiting request never reached the model
        assert httpx.get(live.url + "/health", timeout=10).status_code == 503
        assert live.wait_blocks_free()


def test_a_transient_fault_fails_its_request_and_the_server_keeps_serving(
    tiny_checkpoint: Path,
) -> None:
    settings = Settings(model=str(tiny_checkpoint), max_consecutive_failed_steps=3)
    with live_server(settings) as live:
        failures = {"left": 0}

        def fails() -> bool:
            if failures["left"]:
                failures["left"] -= 1
                return True
            return False

        with failing_steps(live.engine.model, fails):
            for _ in range(3):  # two failed steps in a row, then a success resets the count
                failures["left"] = 2
                assert_error(post(live.url), 503, "engine_error")
                assert_error(post(live.url), 503, "engine_error")
                assert httpx.get(live.url + "/health", timeout=10).status_code == 200
                ok = post(live.url)
                assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        health = httpx.get(live.url + "/health", timeout=10)
        assert health.status_code == 200 and health.json()["failed_steps"] == 6
        assert live.state.async_engine.consecutive_failed_steps == 0


# `gptserve serve` whose model's every step raises
STICKY_FAULT_SERVER = """
import sys
import gptserve.model.gpt as gpt_module

def broken(self, *args, **kwargs):
    raise RuntimeError("injected sticky fault")

gpt_module.GPT.forward_cached = broken
from gptserve.server.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(120)
def test_exit_on_engine_failure_ends_the_process_with_status_1(tiny_checkpoint: Path) -> None:
    port = free_port()
    args = ["--model", str(tiny_checkpoint), "--port", str(port), "--shutdown-grace", "2",
            "--exit-on-engine-failure", "--max-consecutive-failed-steps", "2"]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", STICKY_FAULT_SERVER, *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(url, proc)
        assert_error(post(url), 503, "engine_error")
        assert proc.poll() is None  # one failed step: still serving
        try:
            assert_error(post(url), 503, "engine_error")
        except httpx.TransportError:  # it may already be closing its connections
            pass
        code = proc.wait(timeout=60)
        stderr = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: the last 2 engine steps in a row failed"), stderr
    assert "injected sticky fault" not in last  # the cause is in the log above it
    assert "injected sticky fault" in stderr


def test_the_flags_parse() -> None:
    assert settings_from_args([]).max_consecutive_failed_steps == 3
    assert settings_from_args([]).exit_on_engine_failure is False
    parsed = settings_from_args(["--max-consecutive-failed-steps", "5", "--exit-on-engine-failure"])
    assert parsed.max_consecutive_failed_steps == 5 and parsed.exit_on_engine_failure is True


def test_rays_health_check_fails_for_an_unhealthy_engine(tiny_checkpoint: Path) -> None:
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed")
    from gptserve.server.ray.deployment import Replica, ScaleOptions

    settings = Settings(model=str(tiny_checkpoint), max_consecutive_failed_steps=1)
    with live_server(settings) as live:
        replica = Replica(ScaleOptions())
        replica.app, replica.loaded = live.app, True  # what serve.ingress and the load give it
        asyncio.run(replica.check_health())  # healthy: returns
        with failing_steps(live.engine.model, lambda: True):
            assert_error(post(live.url), 503, "engine_error")
        with pytest.raises(RuntimeError, match="engine_unhealthy"):
            asyncio.run(replica.check_health())
