"""The bundled Shakespeare model: present, small, trained, and served by `--model shakespeare`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import torch
import torch.nn.functional as F
from gptserve.model import SHAKESPEARE_DIR, get_tokenizer, load_checkpoint

from tests.server.conftest import free_port, wait_for_server

REPO = Path(__file__).resolve().parents[2]


def test_shakespeare_model_is_small_and_trained(shakespeare_path: Path) -> None:
    weights = SHAKESPEARE_DIR / "model.safetensors"
    assert weights.stat().st_size < 64 * 2**20
    model = load_checkpoint(SHAKESPEARE_DIR, dtype=torch.float32)
    tok = get_tokenizer(model.config.tokenizer)
    # the corpus's last tenth is train.py's validation split: text the model never trained on
    text = shakespeare_path.read_text()
    ids = tok.encode(text[-len(text) // 20 :])
    T = model.config.block_size
    batch = torch.tensor(ids[: 8 * T]).view(8, T)
    with torch.no_grad():
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    assert loss.item() < 5.5  # an untrained model scores about ln(50257) = 10.8


def test_python_m_server_serves_the_shakespeare_model(shakespeare_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptserve.server", "--model", "shakespeare", "--port", str(port)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(url, proc, timeout=120)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()
        assert models["data"][0]["id"] == "shakespeare"
        # it is the trained model that answers: it scores unseen Shakespeare well
        text = shakespeare_path.read_text()
        passage = text[-len(text) // 20 :][:600]  # about 200 tokens: within the 256 context
        body = {"prompt": passage, "max_tokens": 0, "echo": True, "logprobs": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        scores = r.json()["choices"][0]["logprobs"]["token_logprobs"][1:]
        assert -sum(scores) / len(scores) < 5.5  # an untrained model: about ln(50257) = 10.8
        body = {"prompt": "ROMEO:\n", "max_tokens": 40, "temperature": 0.8, "seed": 3}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        out = r.json()
        assert out["choices"][0]["text"] and out["usage"]["completion_tokens"] <= 40
    finally:
        proc.terminate()
        proc.wait(timeout=60)
