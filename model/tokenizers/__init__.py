"""Tokenizers: the `Tokenizer` protocol every caller reads (`base`), GPT-2's BPE through tiktoken
(`gpt2`), a checkpoint's own `tokenizer.json` (`hf`), a GGUF file's vocabulary rebuilt from its
metadata (`gguf`), and `load_tokenizer`, which picks the one a checkpoint names (`loader`)."""

from model.tokenizers.base import IncrementalDetokenizer, Tokenizer, TokenizerError
from model.tokenizers.gpt2 import GPT2Tokenizer
from model.tokenizers.hf import HFTokenizer
from model.tokenizers.loader import get_tokenizer, load_tokenizer

__all__ = [
    "GPT2Tokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
    "get_tokenizer",
    "load_tokenizer",
]
