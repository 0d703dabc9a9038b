"""`gptserve export`: a model, with a LoRA adapter merged into its weights, as one GGUF file.

    gptserve export --model shakespeare --lora runs/lora --out shakespeare-lora.gguf --type q8_0
    gptserve export --model smollm2-135m-instruct --out smollm2.gguf --type f16

--model takes what `gptserve serve --model` takes (a known name, a GGUF file, a Hugging Face
directory, a train.py output directory). The model loads in float32 (a GGUF file's quantized
matrices dequantized), the adapter (a PEFT directory, as `--lora` serves it) is added into its
weights, and the file is written (`model.gguf.writer`) with the tokenizer gptserve serves the
model with and its chat template (a plain "Role: content" template translated to Jinja) in the
metadata. llama.cpp loads the file; `gptserve serve --model FILE` serves it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from gptserve.engine.adapters import read_adapter
from gptserve.engine.errors import RequestError
from gptserve.model.checkpoint import CheckpointError, load_checkpoint
from gptserve.model.gguf.vocab import GGUFVocab, VocabError, gguf_vocab, gpt2_vocab, hf_vocab
from gptserve.model.gguf.writer import FORMATS, GGUFWriteError, write_model_gguf
from gptserve.model.known_models import FetchError, resolve_model
from gptserve.model.lora.merge import merge_into
from gptserve.model.tokenizers import TokenizerError, load_tokenizer
from gptserve.server.chat.plain_jinja import plain_to_jinja
from gptserve.server.chat.templates import (
    ChatTemplate,
    ChatTemplateError,
    JinjaChat,
    load_chat_format,
)


class ExportError(RuntimeError):
    """Why the export cannot be made; one line for the user."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gptserve export",
        description="write a model, with a LoRA adapter merged, as a GGUF file for llama.cpp "
        "and gptserve",
    )
    parser.add_argument(
        "--model", required=True,
        help="what `gptserve serve --model` takes: a known model's name, a GGUF file, a Hugging "
        "Face directory or a train.py output directory",
    )  # fmt: skip
    parser.add_argument(
        "--lora", default=None, metavar="DIR",
        help="a PEFT LoRA adapter directory for --model, merged into the weights",
    )  # fmt: skip
    parser.add_argument("--out", required=True, metavar="FILE.gguf", help="the file to write")
    parser.add_argument(
        "--type", default="f16", metavar="TYPE",
        help=f"the matrices' type: {', '.join(FORMATS)} (default f16; vectors stay f32)",
    )  # fmt: skip
    parser.add_argument("--name", default=None, help="general.name (default: the file's stem)")
    return parser.parse_args(argv)


def export(model_spec: str, out: str | Path, fmt: str, lora: str | Path | None = None,
           name: str | None = None) -> Path:  # fmt: skip
    """Write `model_spec` (with the adapter at `lora` merged) to `out` as GGUF of type `fmt`;
    raises ExportError with one line."""
    out = Path(out)
    if fmt not in FORMATS:
        raise ExportError(f"unknown --type {fmt!r}; choose from {', '.join(FORMATS)}")
    if out.suffix != ".gguf":
        raise ExportError(f"--out {out}: the file name must end in .gguf (how it is recognized)")
    if lora is not None and not Path(lora).is_dir():
        raise ExportError(f"--lora {lora}: no adapter directory there")
    try:
        path = resolve_model(model_spec)
        model = load_checkpoint(path, dtype=torch.float32)
        vocab, template = tokenizer_and_template(model.config.tokenizer, path)
        if lora is not None:
            adapter = read_adapter(lora, model.config, Path(lora).resolve().name)
            merge_into(model, adapter)
        out.parent.mkdir(parents=True, exist_ok=True)
        return write_model_gguf(out, model, fmt, vocab, template, name)
    except (FetchError, CheckpointError, TokenizerError, ChatTemplateError, VocabError,
            GGUFWriteError, RequestError, ValueError, OSError, RuntimeError) as exc:  # fmt: skip
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ExportError(text) from None


def tokenizer_and_template(kind: str, path: Path) -> tuple[GGUFVocab, str]:
    """The tokenizer (`kind`: the config's) and the Jinja source of the chat template that
    gptserve serves the checkpoint at `path` with; a GGUF file's are its own metadata's."""
    if kind == "gguf":
        from gptserve.model.gguf.checkpoint import read_metadata

        meta = read_metadata(path)  # once: a large vocabulary takes seconds to parse
        source = meta.get("tokenizer.chat_template")
        return gguf_vocab(meta), source if source else plain_to_jinja(ChatTemplate())
    tokenizer = load_tokenizer(kind, path)
    chat = load_chat_format(path, tokenizer)
    source = chat.source if isinstance(chat, JinjaChat) else plain_to_jinja(chat)
    if kind == "gpt2":
        return gpt2_vocab(), source
    if kind == "hf":
        return hf_vocab(path, tokenizer), source
    raise ExportError(f"tokenizer {kind!r} cannot be written to GGUF")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        path = export(args.model, args.out, args.type, args.lora, args.name)
    except ExportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    merged = f", adapter {Path(args.lora).name} merged" if args.lora else ""
    print(
        f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {args.type}{merged}) "
        f"in {time.perf_counter() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
