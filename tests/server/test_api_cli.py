"""`gptserve serve` as a process: one-line errors with exit 2, and a SIGTERM drain that exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import MISSING, fields
from pathlib import Path

import httpx
import pytest
from gptserve.model import get_tokenizer
from gptserve.server.chat.templates import ChatTemplate, ChatTemplateError
from gptserve.server.settings import Settings, SettingsError, build_parser, settings_from_args

from tests.server.conftest import free_port, wait_for_server

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "gptserve.server", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_missing_bundled_model_is_one_line_exit_2() -> None:
    missing = "/nonexistent/default_model"
    code = (
        "import sys; import gptserve.model as model; from pathlib import Path; "
        f"model.SHAKESPEARE_DIR = Path({missing!r}); "
        "from gptserve.server.cli import main; sys.exit(main(['--model', 'shakespeare', '--port', '1']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and missing in out.stderr
    assert out.stderr.startswith("error: ")


@pytest.mark.parametrize(
    "args",
    [["--max-n", "0"], ["--model", "/nonexistent/ckpt"], ["--port", "99999"], ["--device", "tpu"]],
)
def test_bad_flags_exit_2(args: list[str]) -> None:
    out = run_cli(*args)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr and "error:" in out.stderr


def test_a_kv_cache_wider_than_the_model_is_one_line_exit_2_before_loading() -> None:
    out = run_cli("--model", "shakespeare", "--dtype", "bfloat16", "--kv-cache-dtype", "float32")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert out.stderr.startswith("error: --kv-cache-dtype float32 does not go with a bfloat16")


def test_int8_activations_without_int4_products_is_one_line_exit_2() -> None:
    out = run_cli("--model", "shakespeare", "--quantize", "int8", "--int8-activations")
    assert out.returncode == 2 and out.stderr.strip().count("\n") == 0, out.stderr
    assert "--int8-activations takes a GGUF file's int4 products" in out.stderr
    out = run_cli("--model", "shakespeare", "--int8-activations", "--port", str(free_port()))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: --int8-activations needs int4")


def test_unloadable_checkpoint_exit_2(tmp_path: Path) -> None:
    """The checkpoint fails while loading, after the port is bound: the server stops and the
    process ends with one `error:` line naming the file, and status 2."""
    (tmp_path / "config.json").write_text("{not json")
    out = run_cli("--model", str(tmp_path), "--port", str(free_port()))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: cannot read ") and "config.json" in last


def test_a_taken_port_is_one_line_exit_2_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = run_cli("--port", str(port))
    assert out.returncode == 2
    assert out.stderr.startswith(f"error: cannot bind 127.0.0.1:{port}: ")
    assert out.stderr.count("\n") == 1 and "in use" in out.stderr


# `gptserve serve` whose checkpoint load waits until a file appears (at most 60 s)
GATED_SERVER = """
import sys, time
from pathlib import Path
import gptserve.engine.loader as loader
real = loader.load_checkpoint
def gated(*args, **kwargs):
    deadline = time.monotonic() + 60
    while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return real(*args, **kwargs)
loader.load_checkpoint = gated
from gptserve.server.cli import main
sys.exit(main(sys.argv[2:]))
"""


def start_gated_server(gate: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """A gated server process and its URL, once its port answers."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", GATED_SERVER, str(gate), "--port", str(port), *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for_server(url, proc, ready=False)
    return proc, url


def test_health_answers_loading_over_http_until_the_model_serves(
    tiny_checkpoint: Path, tmp_path: Path
) -> None:
    gate = tmp_path / "load-now"
    proc, url = start_gated_server(gate, "--model", str(tiny_checkpoint), "--api-key", "k")
    try:
        health = httpx.get(f"{url}/health", timeout=5)
        assert (health.status_code, health.json()) == (503, {"status": "loading"})
        body = {"prompt": "a", "max_tokens": 1}
        auth = {"Authorization": "Bearer k"}
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "the model is still loading", "type": "server_error", "param": None,
            "code": "loading",
        }  # fmt: skip
        assert httpx.get(f"{url}/metrics", timeout=5).status_code == 200
        gate.touch()
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"{url}/health", timeout=5)).status_code != 200:
            assert health.json() == {"status": "loading"}
            assert time.monotonic() < deadline, "the model never became ready"
            time.sleep(0.05)
        assert health.json()["status"] == "ok" and health.json()["model"] == tiny_checkpoint.name
        r = httpx.post(f"{url}/v1/completions", json=body, headers=auth, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
    finally:
        proc.kill()
        proc.wait(10)


def test_sigterm_while_loading_exits_0_at_once(tiny_checkpoint: Path, tmp_path: Path) -> None:
    proc, url = start_gated_server(tmp_path / "never", "--model", str(tiny_checkpoint))
    try:
        assert httpx.get(f"{url}/health", timeout=5).json() == {"status": "loading"}
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - t0 < 10  # it did not wait for the load
        assert "Traceback" not in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_settings_from_args_env_keys() -> None:
    s = settings_from_args(
        ["--api-key", "a", "--max-queue", "3"], env={"GPTSERVE_API_KEYS": "b, c"}
    )
    assert s.api_keys == ["a", "b", "c"] and s.max_queue == 3 and s.host == "127.0.0.1"
    with pytest.raises(SettingsError):
        settings_from_args(["--kv-cache-gb", "0"], env={})


def test_the_command_line_is_the_settings_dataclass() -> None:
    assert settings_from_args([], env={}) == Settings()
    flags = {a.dest: a for a in build_parser()._actions if a.option_strings and a.dest != "help"}
    assert set(flags) == {f.name for f in fields(Settings)}
    for f in fields(Settings):
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        assert flags[f.name].default == default, f.name  # a list flag (repeatable) starts empty
    parsed = settings_from_args(
        ["--max-n", "3", "--kv-cache-gb", "0.5", "--max-prompt-tokens", "9"]
    )
    assert (parsed.max_n, parsed.kv_cache_gb, parsed.max_prompt_tokens) == (3, 0.5, 9)
    help_text = " ".join(build_parser().format_help().split())
    assert (
        "--max-concurrent-requests MAX_CONCURRENT_REQUESTS HTTP requests in flight (429 above"
        in help_text
    )
    assert "(default: None)" not in help_text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-logprobs", "21"], "--max-logprobs must be between 0 and 20"),
        (["--port", "-1"], "--port must be between 0 and 65535"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens must be >= 1"),
        (["--max-stop", "-1"], "--max-stop must be >= 0"),
        (["--request-timeout", "0"], "--request-timeout must be > 0"),
        (["--shutdown-grace", "-1"], "--shutdown-grace must be >= 0"),
        (["--api-key", ""], "API keys must be non-empty"),
    ],
)
def test_flag_ranges(args: list[str], message: str) -> None:
    with pytest.raises(SettingsError) as exc:
        settings_from_args(args, env={})
    assert str(exc.value) == message


def test_chat_template_default_and_file(tmp_path: Path) -> None:
    default = ChatTemplate()
    assert (
        default.render([("system", "S"), ("user", "{x} hi")])
        == "System: S\nUser: {x} hi\nAssistant:"
    )
    assert default.stop == ("\nUser:",)
    (tmp_path / "chat_template.txt").write_text(
        "<{role}>{content}</{role}>\n\n---\n<assistant>\n---\n</assistant>\n\\n<user>\n"
    )
    custom = ChatTemplate.for_checkpoint(tmp_path)
    assert custom.render([("user", "hey")]) == "<user>hey</user>\n<assistant>"
    assert custom.stop == ("</assistant>", "\n<user>")
    with pytest.raises(ChatTemplateError):
        ChatTemplate.parse("no separator here")


def test_a_follow_up_turn_starts_with_the_tokens_generated_before() -> None:
    template, tok = ChatTemplate(), get_tokenizer()
    first = [("system", "You are terse."), ("user", "Who is Romeo?")]
    prompt = tok.encode(template.render(first))
    answer = tok.encode(" A young man of Verona, in love with Juliet.")  # as a model writes it
    follow_up = [*first, ("assistant", tok.decode(answer)), ("user", "And Tybalt?")]
    rendered = template.render(follow_up)
    assert rendered.startswith(template.render(first) + tok.decode(answer) + "\n")
    assert tok.encode(rendered)[: len(prompt) + len(answer)] == prompt + answer
    # content without a leading space keeps the template's own
    assert template.render([("user", "hi")]) == "User: hi\nAssistant:"


def test_sigterm_drains_stream_and_exits_0(tiny_checkpoint: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptserve.server", "--model", str(tiny_checkpoint), "--port", str(port), "--shutdown-grace", "120"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_server(url, proc)
        body = {"prompt": "a", "max_tokens": 64, "ignore_eos": True, "stream": True}
        received: list[str] = []
        first = threading.Event()

        def consume() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        received.append(line)
                        first.set()

        reader = threading.Thread(target=consume)
        reader.start()
        assert first.wait(30)
        os.kill(proc.pid, signal.SIGTERM)
        reader.join(150)
        assert not reader.is_alive()
        assert proc.wait(timeout=150) == 0
        assert received[-1] == "data: [DONE]"
        last = json.loads(received[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"  # the stream finished, not cut
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
