"""Tokenizers: the `Tokenizer` protocol every caller reads (`base`), GPT-2's BPE through tiktoken
(`gpt2`), a checkpoint's own `tokenizer.json` (`hf`), a GGUF file's vocabulary rebuilt from its
metadata (`gguf`), and `load_tokenizer`, which picks the one a checkpoint names (`loader`)."""

from gptserve.model.tokenizers.base import IncrementalDetokenizer, Tokenizer, TokenizerError
from gptserve.model.tokenizers.gpt2 import GPT2Tokenizer
from gptserve.model.tokenizers.hf import HFTokenizer
from gptserve.model.tokenizers.loader import get_tokenizer, load_tokenizer

__all__ = [
    "GPT2Tokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
    "get_tokenizer",
    "load_tokenizer",
]
