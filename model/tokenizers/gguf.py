"""A GGUF file's tokenizer, rebuilt from its metadata as a Hugging Face `tokenizers.Tokenizer`.

GGUF files of byte-level BPE models (`tokenizer.ggml.model` "gpt2") carry the vocabulary, the
merges and each token's type, and name their pre-tokenizer (`tokenizer.ggml.pre`): how text is
split into words before BPE. The split rules below are those of the tokenizers the names stand
for (GPT-2's, Llama 3's, Qwen2's, SmolLM's); control tokens (type 3) become special tokens and
user-defined ones (type 4) added tokens, both matched whole in text.

Gemma 3 files carry a SentencePiece vocabulary (`tokenizer.ggml.model` "llama") and no merges:
spaces are written "▁", no space is prepended, bytes outside the vocabulary fall back to
its "<0xNN>" tokens, and the merges are the vocabulary's own pieces, each token split into two
tokens of the vocabulary, ranked by the token's place in the file (earlier first) and, within a
token, the longer left part first: the tokenizer transformers rebuilds from such a file. Other
SentencePiece files (Llama 2's, with a prepended space) are refused.
"""

from __future__ import annotations

from typing import Any

from gptserve.model.tokenizers.base import TokenizerError
from gptserve.model.tokenizers.hf import HFTokenizer
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama 3 and Qwen2 differ in how many digits make a word: up to three, or one
_LLAMA3_LIKE = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}%s"""
    r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
LLAMA3_SPLIT = _LLAMA3_LIKE % "{1,3}"
QWEN2_SPLIT = _LLAMA3_LIKE % ""

CONTROL, USER_DEFINED = 3, 4


def _pre_tokenizer(name: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if name in ("gpt-2", "gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":  # every digit on its own, then GPT-2's split
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    splits = {"llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}
    if name not in splits:
        known = "gpt-2, llama-bpe, qwen2, smollm"
        raise TokenizerError(f"GGUF pre-tokenizer {name!r} is not supported (supported: {known})")
    split = pre_tokenizers.Split(Regex(splits[name]), behavior="isolated", invert=False)
    return pre_tokenizers.Sequence([split, byte_level])


SPACE = "\u2581"  # SentencePiece's space


def _gemma_pieces(tokens: list[str]) -> list[str]:
    """Gemma files store tokens of only spaces as spaces; the vocabulary spells them with "▁"."""
    return [SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def sentencepiece_merges(tokens: list[str]) -> list[tuple[str, str]]:
    """The merges a merge-less SentencePiece vocabulary implies (module docstring): for each token
    in file order, each split into two tokens of the vocabulary, the longer left part first."""
    vocab = set(tokens)
    merges: list[tuple[str, str]] = []
    for token in tokens:
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _gemma_tokenizer(meta: dict[str, Any], tokens: list[str]) -> RustTokenizer:
    """Gemma's SentencePiece BPE over the file's vocabulary (module docstring)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else "<unk>"
    model = models.BPE(
        vocab=vocab, merges=sentencepiece_merges(tokens), unk_token=unk_token, fuse_unk=True,
        byte_fallback=True,
    )  # fmt: skip
    tok = RustTokenizer(model)
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tok


def _byte_level_tokenizer(meta: dict[str, Any], tokens: list[str]) -> RustTokenizer:
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    return tok


def tokenizer_from_gguf(meta: dict[str, Any], name: str = "gguf") -> HFTokenizer:
    """An HFTokenizer for the `tokenizer.ggml.*` metadata of a byte-level BPE GGUF file, or of a
    Gemma 3 file's SentencePiece vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    arch = meta.get("general.architecture")
    tokens: list[str] = list(meta.get("tokenizer.ggml.tokens") or [])
    if kind == "gpt2":
        tok = _byte_level_tokenizer(meta, tokens)
        add_bos_default = False
    elif kind == "llama" and arch == "gemma3":
        tokens = _gemma_pieces(tokens)
        tok = _gemma_tokenizer(meta, tokens)
        add_bos_default = True  # llama.cpp's default for a SentencePiece vocabulary
    else:
        raise TokenizerError(
            f"GGUF tokenizer model {kind!r} of architecture {arch!r} is not supported "
            "(byte-level BPE 'gpt2', or Gemma 3's SentencePiece 'llama')"
        )
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types)
            if k == CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types)
            if k == USER_DEFINED
        ]
    )

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    eot = meta.get("tokenizer.ggml.eot_token_id")
    return HFTokenizer(
        tok,
        name=name,
        eos_token=token("eos"),
        bos_token=token("bos"),
        extra_eos_ids=[eot] if isinstance(eot, int) else None,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
    )
