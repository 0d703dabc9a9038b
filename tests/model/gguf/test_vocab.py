"""Tokenizers as GGUF metadata (`model.gguf.vocab`): rebuilt from the metadata, they encode as
the source does; a pre-tokenizer GGUF cannot name, or a SentencePiece vocabulary, is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gptserve.model.gguf.vocab import UNUSED, VocabError, gguf_vocab, gpt2_vocab, hf_vocab
from gptserve.model.tokenizers import load_tokenizer
from gptserve.model.tokenizers.gguf import tokenizer_from_gguf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from tests.conftest import byte_level_bpe

TEXT = "ROMEO: 12345 apples, caf\u00e9!\n\n  <|end|> What's    this?"


def save(tok: Tokenizer, directory: Path) -> Path:
    directory.mkdir()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return directory


@pytest.fixture(scope="module")
def corpus(shakespeare_path: Path) -> list[str]:
    text = shakespeare_path.read_text(encoding="utf-8")[:50_000]
    return [text[i : i + 1000] for i in range(0, len(text), 1000)]


@pytest.mark.parametrize("pre", ["gpt-2", "smollm"])
def test_hf_tokenizer_round_trips_with_its_pre_tokenizer(
    pre: str, corpus: list[str], tmp_path: Path
) -> None:
    tok = byte_level_bpe(corpus, 300, ["<|end|>"])
    if pre == "smollm":  # every digit on its own first, as SmolLM's tokenizer
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), tok.pre_tokenizer]
        )
    directory = save(tok, tmp_path / "tok")
    source = load_tokenizer("hf", directory)
    vocab = hf_vocab(directory, source)
    assert vocab.pre == pre
    rebuilt = tokenizer_from_gguf(vocab.padded(320).metadata())
    assert rebuilt.encode(TEXT) == source.encode(TEXT)
    assert vocab.padded(320).types[-1] == UNUSED and rebuilt.eot_token == source.eot_token


def test_a_sentencepiece_tokenizer_is_refused(tmp_path: Path) -> None:
    tok = Tokenizer(models.BPE(vocab={"\u2581a": 0, "<|end|>": 1}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    directory = save(tok, tmp_path / "sp")
    with pytest.raises(VocabError, match="only byte-level BPE"):
        hf_vocab(directory, load_tokenizer("hf", directory))


def test_gpt2_vocab_rebuilds_gpt2s_tokenizer() -> None:
    vocab = gpt2_vocab()
    rebuilt = tokenizer_from_gguf(vocab.metadata())
    assert rebuilt.encode(TEXT) == load_tokenizer("gpt2").encode(TEXT)
    assert gguf_vocab(vocab.metadata()) == vocab  # a file's metadata is copied as it is
