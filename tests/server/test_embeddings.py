"""POST /v1/embeddings over HTTP.

Tiny random Llama and Qwen3 models saved by transformers (tests/model/test_hf_llama.py) with a
word-level tokenizer: each vector must equal transformers' `hidden_states[-1]` (the final hidden
states after the final norm) pooled the same way and normalized, for inputs of mixed lengths, some
longer than --max-batch-tokens (chunked), sent while a streamed completion is generating (whose
tokens must stay transformers' greedy ones). base64 decodes to the same floats, the `openai`
client works unchanged, and the errors name their field.
"""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F
from gptserve.engine.limits import RequestLimits
from gptserve.server.embeddings_api import encode_base64
from gptserve.server.settings import Settings

from tests.model.test_hf_llama import VOCAB, make
from tests.server.conftest import API_KEY, MODEL_NAME, live_server, slow_steps
from tests.server.test_hf_models_served import (
    NEW_TOKENS,
    save_word_tokenizer,
    transformers_greedy,
)

transformers = pytest.importorskip("transformers")

LENGTHS = (3, 9, 40, 70, 100)  # --max-batch-tokens 32: the last three are chunked


def reference(model, prompt: list[int], mode: str) -> list[float]:  # noqa: ANN001
    with torch.no_grad():
        h = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    return F.normalize(h[-1] if mode == "last" else h.mean(0), dim=-1).tolist()


def floats(b64: str) -> list[float]:
    raw = base64.b64decode(b64)
    return list(struct.unpack(f"<{len(raw) // 4}f", raw))


def close(got: list[float], want: list[float], tol: float = 1e-5) -> bool:
    return len(got) == len(want) and max(abs(a - b) for a, b in zip(got, want)) < tol


@pytest.mark.parametrize(
    ("kind", "mode", "st_config"),
    [
        ("llama-gqa-untied", "last", None),  # no sentence-transformers config: last
        ("qwen3-qknorm-headdim", "mean", {"pooling_mode_mean_tokens": True}),  # the checkpoint's
    ],
)
def test_vectors_equal_transformers_while_a_stream_generates(
    kind: str, mode: str, st_config: dict | None, tmp_path: Path
) -> None:
    ref = make(kind, tmp_path)
    save_word_tokenizer(tmp_path)
    if st_config is not None:
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(st_config))
    gen = torch.Generator().manual_seed(7)
    inputs = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    want = [reference(ref, p, mode) for p in inputs]
    gen_prompt = inputs[1]
    greedy = transformers_greedy(ref, gen_prompt)

    async def scenario(url: str) -> tuple[list[int], list[dict]]:
        started = asyncio.Event()
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:

            async def stream() -> list[int]:
                body = {"prompt": gen_prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
                        "ignore_eos": True, "stream": True}  # fmt: skip
                text = ""
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                            started.set()
                return [int(word[1:]) for word in text.split()]

            async def embed(fmt: str) -> dict:
                await started.wait()  # while the completion is generating
                body = {"model": tmp_path.name, "input": inputs, "encoding_format": fmt}
                response = await client.post("/v1/embeddings", json=body)
                assert response.status_code == 200, response.text
                return response.json()

            jobs = (stream(), embed("float"), embed("base64"))
            tokens, *answers = await asyncio.wait_for(asyncio.gather(*jobs), 120)
            return tokens, answers

    settings = Settings(model=str(tmp_path), max_num_seqs=8, max_batch_tokens=32)
    with live_server(settings) as live:
        slow_steps(live, 0.01)
        tokens, (as_floats, as_base64) = asyncio.run(scenario(live.url))
        assert live.wait_blocks_free()
    assert tokens == greedy
    assert as_floats["object"] == "list" and as_floats["model"] == tmp_path.name
    assert as_floats["usage"] == {"prompt_tokens": sum(LENGTHS), "total_tokens": sum(LENGTHS)}
    for i, (item, b64) in enumerate(zip(as_floats["data"], as_base64["data"])):
        assert item["object"] == "embedding" and item["index"] == i
        assert close(item["embedding"], want[i]), (i, LENGTHS[i])
        # the same vector (a batch of other composition may round the mean's sum otherwise)
        assert close(floats(b64["embedding"]), item["embedding"], 1e-6)
    vector = as_floats["data"][0]["embedding"]
    assert floats(encode_base64(vector)) == vector  # float32 values go through exactly


def test_the_openai_client_and_the_pooling_flag(tmp_path: Path) -> None:
    openai = pytest.importorskip("openai")
    ref = make("llama-gqa-untied", tmp_path)
    save_word_tokenizer(tmp_path)
    texts = ["t5 t9 t200 t17", "t3"]
    ids = [[5, 9, 200, 17], [3]]
    settings = Settings(model=str(tmp_path), pooling="mean", api_keys=[API_KEY])
    with live_server(settings) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key=API_KEY)
        answer = client.embeddings.create(model=tmp_path.name, input=texts)  # base64 on the wire
        by_ids = client.embeddings.create(model=tmp_path.name, input=ids, encoding_format="float")
    assert answer.usage.prompt_tokens == 5
    for item, other, prompt in zip(answer.data, by_ids.data, ids):
        assert close(item.embedding, reference(ref, prompt, "mean"))
        assert item.embedding == other.embedding


def post(server, headers, body: dict) -> httpx.Response:  # noqa: ANN001
    return httpx.post(f"{server.url}/v1/embeddings", json=body, headers=headers, timeout=30)


def test_a_gpt2_checkpoint_embeds_behind_the_api_key(server, headers) -> None:  # noqa: ANN001
    assert post(server, {}, {"input": "hi"}).status_code == 401
    response = post(server, headers, {"input": ["To be", "or not"], "dimensions": 64})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == [0, 1]
    for d in data:
        assert len(d["embedding"]) == 64
        assert abs(sum(x * x for x in d["embedding"]) - 1) < 1e-4
    assert server.wait_blocks_free()


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        ({"input": "hi", "model": "other"}, 404, "model", "model_not_found"),
        ({"input": []}, 400, "input", None),
        ({"input": ""}, 400, "input", None),
        ({"input": ["a", ""]}, 400, "input", None),
        ({"input": [[]]}, 400, "input", None),
        ({"input": ["a"] * 17}, 400, "input", None),  # --max-prompts 16
        ({"input": [1] * 300}, 400, "input", "context_length_exceeded"),  # context 256
        ({"input": [1, 10**6]}, 400, "input", None),
        ({"input": [-1]}, 400, "input", None),
        ({"input": "hi", "dimensions": 32}, 400, "dimensions", None),  # not Matryoshka
        ({"input": "hi", "encoding_format": "int8"}, 400, "encoding_format", None),
        ({"input": 5}, 400, "input", None),
    ],
)
def test_errors_name_their_field(server, headers, body, status, param, code) -> None:  # noqa: ANN001
    response = post(server, headers, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert MODEL_NAME  # the shared server serves tiny-gpt


def test_an_embeddings_request_is_admitted_once(server, headers, monkeypatch) -> None:  # noqa: ANN001
    """Through `RequestLimits.admit`, once for all its inputs, naming `input`, generating nothing."""
    calls: list[tuple] = []
    real = RequestLimits.admit

    def counted(self, prompts, params, names=None, constrained=False):  # noqa: ANN001, ANN202
        calls.append((len(prompts), names.prompt, params.max_tokens))
        return real(self, prompts, params, names, constrained)

    monkeypatch.setattr(RequestLimits, "admit", counted)
    assert post(server, headers, {"input": ["To be", "or not", "to be"]}).status_code == 200
    assert calls == [(3, "input", 0)]
