"""GPT-2 BPE built offline: known ids, whole-corpus round trip, streaming detokenization."""

import pytest
from gptserve.model import get_tokenizer
from gptserve.model.tokenizers import TokenizerError


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer("gpt2")


@pytest.mark.parametrize(
    "text,ids",
    [
        ("Hello world", [15496, 995]),
        (" the", [262]),
        ("<|endoftext|>", [27, 91, 437, 1659, 5239, 91, 29]),
        ("I'm here.", [40, 1101, 994, 13]),
    ],
)
def test_known_gpt2_ids(tok, text, ids):
    assert tok.encode(text) == ids
    assert tok.decode(ids) == text


def test_special_token(tok):
    assert tok.eot_token == 50256
    assert tok.vocab_size == 50257
    assert tok.encode("a<|endoftext|>", allow_special=True) == [64, 50256]


def test_corpus_round_trip(tok, shakespeare_path):
    text = shakespeare_path.read_text(encoding="utf-8")
    ids = tok.encode(text)
    assert 1_400_000 < len(ids) < 1_700_000
    assert tok.decode(ids) == text


@pytest.mark.parametrize(
    "text", ["héllo 😀 wörld 🎉🎉", "日本語のテキスト、中文文本。", "a\u200db👩‍👩‍👧"]
)
def test_incremental_decoding_never_splits_characters(tok, text):
    ids = tok.encode(text)
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # some token in these strings carries only part of a character, so something was held back
    assert any(p == "" for p in pieces)


def test_broken_bytes_become_replacement_char(tok):
    partial = tok.encode("😀")[:1]  # first bytes of a 4-byte character only
    detok = tok.detokenizer()
    assert detok.add(partial[0]) == ""
    assert detok.flush() == "\ufffd"


def test_unknown_tokenizer_is_a_clear_error():
    with pytest.raises(TokenizerError, match="unknown tokenizer"):
        get_tokenizer("llama")
