"""Hugging Face Llama-family directories served over HTTP give transformers' greedy tokens.

Each tiny random model is saved by transformers (tests/model/test_hf_llama.py's cases) with a
word-level tokenizer whose tokens are " t0" ... " t255", so a text names its token ids exactly.
Eight completions of mixed prompt lengths go to the server at once (continuous batching, the
CPU wing, grouped-query attention in the paged cache); each answer must be the 32 tokens that
transformers' own greedy loop produces for that prompt alone.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from gptserve.server.settings import Settings

from tests.model.test_hf_llama import VOCAB, make
from tests.server.conftest import live_server

transformers = pytest.importorskip("transformers")
from tokenizers import Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 9, 17, 25, 33, 41, 50, 60)  # eight concurrent requests


def save_word_tokenizer(directory: Path) -> None:
    """A tokenizer.json of VOCAB whole words " t<id>" (SentencePiece-style: the space is the
    word's "\u2581"); " t0" is its EOS."""
    words = {f"\u2581t{i}": i for i in range(VOCAB)}
    rust = Tokenizer(models.WordLevel(words, unk_token="\u2581t0"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Metaspace()
    rust.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "\u2581t0"}))


def transformers_greedy(model, prompt: list[int]) -> list[int]:  # noqa: ANN001
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kind", ["llama-gqa-untied", "qwen3-qknorm-headdim"])
def test_eight_concurrent_requests_get_transformers_greedy_tokens(
    kind: str, tmp_path: Path
) -> None:
    reference = make(kind, tmp_path)
    save_word_tokenizer(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = [transformers_greedy(reference, p) for p in prompts]

    async def complete(client: httpx.AsyncClient, prompt: list[int]) -> str:
        body = {"model": tmp_path.name, "prompt": prompt, "max_tokens": NEW_TOKENS,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def all_at_once(url: str) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            jobs = (complete(client, p) for p in prompts)
            return await asyncio.wait_for(asyncio.gather(*jobs), 120)

    settings = Settings(model=str(tmp_path), max_num_seqs=8)
    with live_server(settings) as live:
        assert live.engine.model.config.kv_heads < live.engine.model.config.n_head
        texts = asyncio.run(all_at_once(live.url))
    for text, want in zip(texts, expected):
        got = [int(word[1:]) for word in text.split()]
        assert got == want
