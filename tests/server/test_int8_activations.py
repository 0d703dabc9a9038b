"""`gptserve serve --int8-activations` end to end: a GGUF file's int4 products take 8-bit rows,
and the server's greedy text is the Engine's over the model loaded that way."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import load_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels.cpu.native import native_ops
from gptserve.model.int4_linear import Int4Linear
from gptserve.server.settings import Settings

from tests.model.gguf.test_gguf import write_gguf
from tests.server.conftest import live_server

pytest.importorskip("gguf")
pytestmark = pytest.mark.skipif(native_ops() is None, reason="no compiled CPU kernels")


def engine_tokens(path: Path, prompt: list[int], new: int, int8_activations: bool) -> list[int]:
    loaded = load_for_inference(path, device="cpu", int8_activations=int8_activations)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=2))
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))
    tokens = []
    while engine.has_work():
        for event in engine.step():
            tokens += event.token_ids
    return tokens


def test_the_server_answers_with_8_bit_rows(tmp_path: Path) -> None:
    path = tmp_path / "llama-q4_1.gguf"
    write_gguf(path, "llama", "Q4_1")
    prompt, new = [5, 17, 42, 7, 99, 3], 12
    want = engine_tokens(path, prompt, new, int8_activations=True)
    with live_server(Settings(model=str(path), int8_activations=True)) as live:
        model = live.app.state.server.loaded.model
        layers = [m for m in model.modules() if type(m) is Int4Linear]
        assert layers and all(m.int8_activations for m in layers)
        body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}  # fmt: skip
        r = httpx.post(f"{live.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == new
    loaded = load_for_inference(path, device="cpu", int8_activations=True)
    assert choice["text"] == loaded.tokenizer.decode(want)
