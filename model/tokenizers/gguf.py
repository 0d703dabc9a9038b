"""A GGUF file's tokenizer, rebuilt from its metadata as a Hugging Face `tokenizers.Tokenizer`.

GGUF files of byte-level BPE models (`tokenizer.ggml.model` "gpt2") carry the vocabulary, the
merges and each token's type, and name their pre-tokenizer (`tokenizer.ggml.pre`): how text is
split into words before BPE. The split rules below are those of the tokenizers the names stand
for (GPT-2's, Llama 3's, Qwen2's, SmolLM's); control tokens (type 3) become special tokens and
user-defined ones (type 4) added tokens, both matched whole in text.
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as RustTokenizer

from model.tokenizers.base import TokenizerError
from model.tokenizers.hf import HFTokenizer

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


def tokenizer_from_gguf(meta: dict[str, Any], name: str = "gguf") -> HFTokenizer:
    """An HFTokenizer for the `tokenizer.ggml.*` metadata of a byte-level BPE GGUF file."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise TokenizerError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2' BPE)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
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
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    )
