"""llama.cpp as a test oracle: greedy tokens of a GGUF file from llama.cpp itself.

Two ways in, the first found: llama.cpp's own `llama-server` binary, looked for in the folder
that the environment variable LLAMACPP_BIN names, else in llama.cpp's build folder under the
user's cache (~/.cache/llamacpp-native/llama.cpp/build/bin, where a native build is kept), else on
PATH; or the `llama_cpp` package (llama-cpp-python). `llamacpp_reason()` says why neither is
there (the tests that need one skip with it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

DEFAULT_BIN = Path.home() / ".cache" / "llamacpp-native" / "llama.cpp" / "build" / "bin"
START_SECONDS = 60


def server_binary() -> Path | None:
    """llama-server from LLAMACPP_BIN, the default build folder, or PATH."""
    folder = os.environ.get("LLAMACPP_BIN")
    for candidate in ([Path(folder)] if folder else []) + [DEFAULT_BIN]:
        binary = candidate / "llama-server"
        if binary.is_file() and os.access(binary, os.X_OK):
            return binary
    found = shutil.which("llama-server")
    return Path(found) if found else None


def llamacpp_reason() -> str | None:
    """None when llama.cpp can run here, else why not (a skip reason)."""
    if server_binary() is not None or importlib.util.find_spec("llama_cpp") is not None:
        return None
    return (
        "llama.cpp not found: set LLAMACPP_BIN to the folder of a llama.cpp build's binaries "
        f"(llama-server), build it in {DEFAULT_BIN}, or pip install llama-cpp-python"
    )


def llamacpp_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """llama.cpp's greedy tokens after `prompt` (token ids, used as given), at most `n`: fewer
    when it meets an end-of-generation token (which it does not return). Float32 KV cache, no
    flash attention, one thread."""
    binary = server_binary()
    if binary is None:
        return _python_greedy(path, prompt, n)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port), "-c", "512",
            "-t", "1", "-np", "1", "-fa", "off", "--cache-type-k", "f32", "--cache-type-v", "f32",
            "--no-warmup"]  # fmt: skip
    server = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_ready(server, port)
        body = {"prompt": prompt, "n_predict": n, "temperature": 0.0, "cache_prompt": False,
                "return_tokens": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as response:
            return [int(t) for t in json.load(response)["tokens"]]
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _wait_ready(server: subprocess.Popen, port: int) -> None:
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited: {server.stderr.read()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server did not start within {START_SECONDS} s")


def _python_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=1, verbose=False)
    out: list[int] = []
    for token in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
        if token == llm.token_eos() or len(out) == n:
            break
        out.append(token)
    return out
