"""What every tokenizer is: the `Tokenizer` protocol, its error, and streams' detokenizer.

The engine, the server and training read a tokenizer only through this interface; the
implementations are `model.tokenizers.gpt2.GPT2Tokenizer` (tiktoken) and
`model.tokenizers.hf.HFTokenizer` (a checkpoint's own `tokenizer.json`, or a GGUF file's).
"""

from __future__ import annotations

import codecs
from typing import Protocol


class TokenizerError(RuntimeError):
    """A tokenizer's data files are missing, unreadable or not what they claim to be."""


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


class Tokenizer(Protocol):
    """What the engine, the server and training need of a tokenizer.

    name: what the tokenizer is called (GPT-2's "gpt2", a checkpoint's folder name);
    fingerprint: identifies the vocabulary (two tokenizers share cached tables, the grammar's,
    only when their fingerprints are equal; GPT-2's is "gpt2"); eot_token: the end-of-text id;
    eos_token_ids: every id that ends a generation (eot_token first); special_token_ids: ids that
    are never text (a grammar never emits them as text); bos_token_id: prepended to a prompt when
    add_bos (Llama), else None; vocab_size: how many ids there are; specials_in_text: whether
    `encode` matches special tokens written in text by default; bos_token, eos_token: those
    special tokens' text as chat templates take them, or None.
    """

    name: str
    fingerprint: str
    eot_token: int
    eos_token_ids: list[int]
    special_token_ids: list[int]
    bos_token_id: int | None
    add_bos: bool
    vocab_size: int
    specials_in_text: bool
    bos_token: str | None
    eos_token: str | None

    def encode(
        self, text: str, allow_special: bool | None = None, add_special_tokens: bool = False
    ) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self, token: int) -> bytes: ...

    def is_valid(self, token: int) -> bool: ...

    def detokenizer(self) -> IncrementalDetokenizer: ...


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
