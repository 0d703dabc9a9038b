"""HFTokenizer against transformers' own fast tokenizer on tokenizers built here: byte-level BPE
(GPT-2, Llama 3, Qwen, SmolLM) and SentencePiece-style BPE with byte fallback (Llama 2, Mistral)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gptserve.model.tokenizers import HFTokenizer, load_tokenizer
from tokenizers import Tokenizer, decoders, models, normalizers, trainers

from tests.conftest import byte_level_bpe

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "  two leading spaces and\ttabs\nnew lines\n\n",
    "Ça coûte 12,50 € — naïve café, Zürich, Ålesund.",
    "日本語のテキストと中文字符。",
    "emoji: 🙂👍🏽 and a family 👨‍👩‍👧",
    "digits 1234567890 3.14159 -42",
    "def f(x):\n    return {'a': [x, x ** 2]}  # code",
    "<|im_start|>user\nhi<|im_end|>",
]


def _corpus(shakespeare_path: Path) -> list[str]:
    text = shakespeare_path.read_text(encoding="utf-8")[:200_000]
    return [text[i : i + 1000] for i in range(0, len(text), 1000)] + TEXTS


def _write(directory: Path, tok: Tokenizer, config: dict, generation: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation))
    return directory


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> Path:
    tok = byte_level_bpe(_corpus(shakespeare_path), 600, SPECIALS)
    config = {"eos_token": "<|im_end|>", "bos_token": None, "tokenizer_class": "GPT2Tokenizer"}
    generation = {"eos_token_id": [2, 0]}
    return _write(tmp_path_factory.mktemp("tok") / "bytelevel", tok, config, generation)


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> Path:
    # learn pieces over "▁"-joined words, then add the 256 byte tokens as Llama 2's vocab has them
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    learner.train_from_iterator(_corpus(shakespeare_path), trainers.BpeTrainer(vocab_size=500))
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in sorted(learned["vocab"], key=learned["vocab"].get):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    config = {"eos_token": "</s>", "bos_token": "<s>", "add_bos_token": True}
    return _write(tmp_path_factory.mktemp("tok") / "sentencepiece", tok, config)


def _reference(directory: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))


@pytest.mark.parametrize("kind", ["byte_level_dir", "sentencepiece_dir"])
def test_ids_and_text_match_transformers(kind: str, request: pytest.FixtureRequest) -> None:
    directory = request.getfixturevalue(kind)
    ours, ref = HFTokenizer.from_directory(directory), _reference(directory)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids), text


@pytest.mark.parametrize("kind", ["byte_level_dir", "sentencepiece_dir"])
def test_a_stream_continues_its_prompt_exactly(kind: str, request: pytest.FixtureRequest) -> None:
    """Token by token after any prefix: no split character, no lost or doubled space."""
    directory = request.getfixturevalue(kind)
    ours, ref = HFTokenizer.from_directory(directory), _reference(directory)
    for text in TEXTS:
        ids = ours.encode(text, allow_special=False)
        whole = ref.decode(ids)
        for k in range(1, len(ids)):
            head = ref.decode(ids[:k])
            if not whole.startswith(head) or "\ufffd" in head:
                continue  # the prefix ends inside a character
            detok = ours.detokenizer()
            streamed = "".join(detok.add(t) for t in ids[k:]) + detok.flush()
            assert head + streamed == whole, (text, k)


def test_special_tokens_in_text(byte_level_dir: Path) -> None:
    ours = HFTokenizer.from_directory(byte_level_dir)
    text = "<|im_start|>user\nhi<|im_end|>"
    start = ours.encode("<|im_start|>")
    assert start == [1] and ours.encode(text)[0] == 1  # matched as one token, as transformers does
    plain = ours.encode(text, allow_special=False)
    assert 1 not in plain and 2 not in plain  # or kept as text when asked
    assert ours.decode(plain) == text
    assert ours.special_token_ids == [0, 1, 2]


def test_end_tokens_and_bos(byte_level_dir: Path, sentencepiece_dir: Path) -> None:
    chatml = HFTokenizer.from_directory(byte_level_dir)
    assert chatml.eot_token == 2 and chatml.eos_token_ids == [2, 0]  # eos, then generation_config
    assert chatml.bos_token_id is None and chatml.encode("a", add_special_tokens=True)[0] != 1
    llama2 = load_tokenizer("hf", sentencepiece_dir)
    assert llama2.eos_token_ids == [2] and llama2.bos_token_id == 1
    assert llama2.encode("hi", add_special_tokens=True)[0] == 1
    assert llama2.encode("hi")[0] != 1
    assert llama2.token_bytes(3 + 0x0A) == b"\n"  # a byte-fallback piece is its byte


def test_a_broken_tokenizer_file_is_one_clear_error(tmp_path: Path) -> None:
    from gptserve.model.tokenizers import TokenizerError

    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        HFTokenizer.from_directory(tmp_path)
