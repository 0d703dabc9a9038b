"""Gemma 3 and Phi-3 directories served over HTTP give transformers' greedy tokens, among
concurrent requests of mixed lengths, past a sliding window of 8; Gemma's chat template (roles user and model) renders as
transformers renders it and its chat answers are transformers' greedy tokens.

The tiny random models are tests/model/test_hf_gemma_phi3.py's, untied (a random model with tied
embeddings mostly repeats its last token), their tokenizer the word-level one of
tests/server/test_hf_models_served.py (" t0" ... " t255": a text names its ids).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import torch
from gptserve.model.tokenizers import HFTokenizer
from gptserve.server.chat.templates import load_chat_format
from gptserve.server.settings import Settings

from tests.model.test_hf_gemma_phi3 import VOCAB, make
from tests.server.conftest import live_server
from tests.server.test_hf_models_served import save_word_tokenizer, transformers_greedy

transformers = pytest.importorskip("transformers")
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers  # noqa: E402

NEW_TOKENS = 32
PROMPT_LENGTHS = (3, 9, 17, 25, 33, 41, 50, 60)  # eight concurrent requests
WINDOW = 8  # every prompt and answer runs past it (Gemma 3: its sliding layers; Phi-3: all)

# Gemma's chat format, written for this test: the system message opens the first user turn,
# roles alternate, the assistant's turns are the "model" role's
GEMMA_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- set prefix = messages[0]['content'] + '\\n\\n' -%}{%- set turns = messages[1:] -%}
{%- else -%}{%- set prefix = '' -%}{%- set turns = messages -%}{%- endif -%}
{%- for m in turns -%}
{%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif -%}
{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n'
   + (prefix if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"""
GEMMA_SPECIALS = ("<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>")


def save_gemma_tokenizer(directory: Path) -> None:
    """Words " t<id>", the roles' words and a newline (each line a word apart), then Gemma's four
    special tokens; its chat template in tokenizer_config.json, as Gemma's directories carry it."""
    extra = ["\u2581user", "\u2581model", "\u2581\n", *GEMMA_SPECIALS]
    words = {f"\u2581t{i}": i for i in range(VOCAB - len(extra))}
    words.update({s: VOCAB - len(extra) + i for i, s in enumerate(extra)})
    rust = Tokenizer(models.WordLevel(words, unk_token="\u2581t0"))
    split_lines = pre_tokenizers.Split("\n", behavior="isolated")
    rust.pre_tokenizer = pre_tokenizers.Sequence([split_lines, pre_tokenizers.Metaspace()])
    rust.decoder = decoders.Metaspace()
    rust.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in GEMMA_SPECIALS])
    rust.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>", "chat_template": GEMMA_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def gather(url: str, path: str, bodies: list[dict]) -> list[dict]:
    async def post(client: httpx.AsyncClient, body: dict) -> dict:
        response = await client.post(path, json=body)
        assert response.status_code == 200, response.text
        return response.json()

    async def all_at_once() -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return await asyncio.wait_for(asyncio.gather(*(post(client, b) for b in bodies)), 120)

    return asyncio.run(all_at_once())


@pytest.mark.parametrize("kind", ["gemma3", "phi3"])
def test_eight_concurrent_requests_get_transformers_greedy_tokens(
    kind: str, tmp_path: Path
) -> None:
    reference = make(kind, tmp_path, sliding_window=WINDOW, tie_word_embeddings=False)
    save_word_tokenizer(tmp_path)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    expected = [transformers_greedy(reference, p) for p in prompts]
    assert len({t for tokens in expected for t in tokens}) > 20  # not one token repeated
    bodies = [
        {"prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
        for p in prompts
    ]
    with live_server(Settings(model=str(tmp_path), max_num_seqs=8)) as live:
        answers = gather(live.url, "/v1/completions", bodies)
    for answer, want in zip(answers, expected):
        got = [int(word[1:]) for word in answer["choices"][0]["text"].split()]
        assert got == want


MESSAGES = [
    {"role": "system", "content": "t7 t8"},
    {"role": "user", "content": "t1 t2 t3"},
    {"role": "assistant", "content": "t4 t5"},
    {"role": "user", "content": "t9 t10 t11 t12"},
]


def test_gemma_chat_template_renders_as_transformers_and_serves_its_greedy_answer(
    tmp_path: Path,
) -> None:
    reference = make("gemma3", tmp_path, sliding_window=WINDOW, tie_word_embeddings=False)
    save_gemma_tokenizer(tmp_path)
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    want = hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ours = HFTokenizer.from_directory(tmp_path)
    chat = load_chat_format(tmp_path, ours)
    assert chat.render_messages(MESSAGES) == want
    assert want.startswith("<bos><start_of_turn>user\nt7 t8\n\nt1 t2 t3<end_of_turn>\n")
    assert "<start_of_turn>model\nt4 t5<end_of_turn>" in want and want.endswith("model\n")

    prompt = ours.encode(want)
    assert prompt == hf_tok(want, add_special_tokens=False)["input_ids"]
    assert 0 not in prompt  # every word known (" t0" is the unknown word)
    expected = ours.decode(transformers_greedy(reference, prompt))
    assert len(set(expected.split())) > 3  # an answer of several words, not one repeated
    body = {"messages": MESSAGES, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    bad = {**body, "messages": MESSAGES[1:2] * 2}  # two user turns in a row
    with live_server(Settings(model=str(tmp_path), max_num_seqs=4)) as live:
        (answer,) = gather(live.url, "/v1/chat/completions", [body])
        refused = httpx.post(f"{live.url}/v1/chat/completions", json=bad, timeout=60)
    assert answer["choices"][0]["message"]["content"].split() == expected.split()
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert refused.status_code == 400
    assert "roles must alternate" in refused.json()["error"]["message"]
