"""The one loader: the tokenizer a checkpoint names, by name ("gpt2", "hf" or "gguf")."""

from __future__ import annotations

from pathlib import Path

from gptserve.model.tokenizers.base import Tokenizer, TokenizerError
from gptserve.model.tokenizers.gguf import tokenizer_from_gguf
from gptserve.model.tokenizers.gpt2 import GPT2Tokenizer, gpt2_encoding
from gptserve.model.tokenizers.hf import HFTokenizer


def get_tokenizer(name: str = "gpt2") -> GPT2Tokenizer:
    """The tokenizer called `name`; only "gpt2" ships."""
    if name != "gpt2":
        raise TokenizerError(f"unknown tokenizer {name!r} (available: 'gpt2')")
    return GPT2Tokenizer(gpt2_encoding())


def load_tokenizer(name: str, directory: str | Path | None = None) -> Tokenizer:
    """The tokenizer a checkpoint names: "gpt2" (tiktoken), "hf" (the `tokenizer.json` of the
    checkpoint's directory) or "gguf" (rebuilt from the GGUF file's metadata)."""
    if name == "gguf":
        if directory is None:
            raise TokenizerError("tokenizer 'gguf' needs the GGUF file")
        # imported here: reading GGUF files needs the `gguf` package, slow to import
        from gptserve.model.gguf.checkpoint import read_metadata

        return tokenizer_from_gguf(read_metadata(Path(directory)), name=Path(directory).stem)
    if name == "hf":
        if directory is None:
            raise TokenizerError("tokenizer 'hf' needs the checkpoint's directory")
        return HFTokenizer.from_directory(directory)
    return get_tokenizer(name)
