"""A checkpoint's own Hugging Face tokenizer (`tokenizer.json`), behind the same interface as GPT-2's.

Two families of vocabularies reach us: byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM: every byte is
mapped to a printable character, "Ġ" is a space) and SentencePiece-style BPE (Llama 2, Mistral:
"▁" is a space, bytes that have no piece are `<0xNN>` tokens). Streams are decoded one token at a
time from each token's exact bytes (`token_bytes`), so a UTF-8 character split over several tokens
is held back until it is whole (`IncrementalDetokenizer`) and spaces are neither dropped nor
doubled. Added tokens (`<|im_start|>`, `<|eot_id|>`, ...) in text are matched as single tokens, as
transformers does by default; `allow_special=False` encodes their text as ordinary text instead.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from gptserve.model.tokenizers.base import IncrementalDetokenizer, TokenizerError, byte_to_unicode
from tokenizers import Tokenizer as RustTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class HFTokenizer:
    """encode/decode with a `tokenizers.Tokenizer`; ids, bytes and special tokens as GPT-2's."""

    specials_in_text = True  # added tokens written in text are matched (transformers' default)

    def __init__(
        self,
        tokenizer: RustTokenizer,
        name: str = "hf",
        eos_token: str | None = None,
        bos_token: str | None = None,
        extra_eos_ids: list[int] | None = None,
        add_bos: bool | None = None,
    ) -> None:
        self._tok = tokenizer
        self._plain: RustTokenizer | None = None  # see `_plain_tokenizer`
        self.name = name
        text = tokenizer.to_str()
        spec = json.loads(text)
        # two tokenizers share cached tables (the grammar's) only when they are the same
        self.fingerprint = hashlib.sha256(text.encode()).hexdigest()[:16]
        added = tokenizer.get_added_tokens_decoder()  # id -> AddedToken
        self.vocab_size: int = max(
            tokenizer.get_vocab_size(with_added_tokens=True), 1 + max(added, default=-1)
        )
        self.special_token_ids: list[int] = sorted(i for i, t in added.items() if t.special)
        self._added_text = {i: t.content for i, t in added.items()}
        self._bytes = _token_bytes_table(tokenizer, spec, self.vocab_size, self._added_text)
        self.bos_token = bos_token
        self.bos_token_id = self._id(bos_token)
        self.eos_token = eos_token
        eos_id = self._id(eos_token)
        ends = [eos_id] if eos_id is not None else []
        ends += [i for i in extra_eos_ids or [] if i not in ends]
        if not ends:
            raise TokenizerError("the tokenizer names no end-of-text token (eos_token)")
        self.eot_token: int = ends[0]
        self.eos_token_ids: list[int] = ends
        self._has_added = bool(added)
        # whether encode(..., add_special_tokens=True) prepends BOS: the post-processor says so
        self.add_bos = (
            add_bos
            if add_bos is not None
            else (
                self.bos_token_id is not None
                and tokenizer.encode("a", add_special_tokens=True).ids[:1] == [self.bos_token_id]
            )
        )

    def _plain_tokenizer(self) -> RustTokenizer:
        """The tokenizer without its added tokens, made on first use (structured output's
        grammar spells its strings with it): for SmolLM2's vocabulary it holds 14 MB."""
        if not self._has_added:
            return self._tok
        if self._plain is None:
            self._plain = _without_added_tokens(json.loads(self._tok.to_str()))
        return self._plain

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ---- the Tokenizer interface ------------------------------------------------------------

    def encode(
        self, text: str, allow_special: bool | None = None, add_special_tokens: bool = False
    ) -> list[int]:
        """Text -> ids. Added tokens written in the text are single tokens unless allow_special
        is False; add_special_tokens adds what the tokenizer adds around a prompt (BOS)."""
        if allow_special is False:
            ids = self._plain_tokenizer().encode(text, add_special_tokens=False).ids
            return ([self.bos_token_id] if add_special_tokens and self.add_bos else []) + ids
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_special_tokens and self.add_bos else []) + ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """A whole text, as the tokenizer decodes it (SentencePiece-style ones drop the space
        they put before the first word; a stream's pieces come from `token_bytes`)."""
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token]

    def is_valid(self, token: int) -> bool:
        return 0 <= token < self.vocab_size

    def detokenizer(self) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self)

    # ---- loading ----------------------------------------------------------------------------

    @classmethod
    def from_directory(cls, directory: str | Path) -> HFTokenizer:
        """The tokenizer of a Hugging Face checkpoint directory (tokenizer.json, with the special
        tokens named in tokenizer_config.json and the end ids of generation_config.json)."""
        directory = Path(directory)
        path = directory / TOKENIZER_FILE
        try:
            tokenizer = RustTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises its own exception types
            raise TokenizerError(f"cannot load {path}: {exc}") from None
        config = read_json(directory / TOKENIZER_CONFIG_FILE)
        generation = read_json(directory / GENERATION_CONFIG_FILE)
        eos = generation.get("eos_token_id")
        extra = [eos] if isinstance(eos, int) else [i for i in eos or [] if isinstance(i, int)]
        return cls(
            tokenizer,
            name=directory.name,
            eos_token=_token_text(config.get("eos_token")),
            bos_token=_token_text(config.get("bos_token")),
            extra_eos_ids=extra,
            add_bos=config.get("add_bos_token"),
        )


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from path, {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"cannot read {path}: {exc}") from None
    return value if isinstance(value, dict) else {}


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json names a token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _decoder_types(spec: dict[str, Any]) -> set[str]:
    decoder = spec.get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return {p.get("type") for p in parts if isinstance(p, dict)}


def _token_bytes_table(
    tokenizer: RustTokenizer, spec: dict[str, Any], size: int, added: dict[int, str]
) -> list[bytes]:
    """Each id's exact bytes in the decoded text."""
    types = _decoder_types(spec)
    byte_level = "ByteLevel" in types
    to_byte = {c: b for b, c in byte_to_unicode().items()}
    table: list[bytes] = []
    for i in range(size):
        if i in added:
            table.append(added[i].encode("utf-8"))
            continue
        piece = tokenizer.id_to_token(i)
        if piece is None:
            table.append(b"")
        elif byte_level:
            table.append(bytes(to_byte[c] for c in piece) if all(c in to_byte for c in piece)
                         else piece.encode("utf-8"))  # fmt: skip
        elif (m := _BYTE_PIECE.fullmatch(piece)) and "ByteFallback" in types:
            table.append(bytes([int(m.group(1), 16)]))
        else:
            table.append(piece.replace("\u2581", " ").encode("utf-8"))
    return table


def _without_added_tokens(spec: dict[str, Any]) -> RustTokenizer:
    """The same tokenizer with no added tokens to match, for text whose specials stay text."""
    plain = dict(spec, added_tokens=[])
    return RustTokenizer.from_str(json.dumps(plain))
