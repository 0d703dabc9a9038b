"""Offline generation: stream a completion for a prompt to the terminal through the Engine.

gptserve generate --model PATH "To be, or not to be"
gptserve generate --model BASE --lora ADAPTER_DIR "To be, or not to be"   # a PEFT LoRA adapter
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from gptserve.engine.adapters import read_adapter
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.errors import RequestError
from gptserve.engine.loader import ModelLoadError, load_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT
from gptserve.model.dtypes import DTYPES
from gptserve.model.known_models import FetchError, resolve_model
from gptserve.model.lora.adapter import LoraAdapter
from gptserve.model.lora.batched import LoraBank, install_lora
from gptserve.model.quantize import QUANTIZATIONS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gptserve generate", description=__doc__.split("\n")[0])
    parser.add_argument("prompt", help="the text to continue")
    parser.add_argument(
        "--model", default=None,
        help="a checkpoint directory, a GGUF file, or a known model's name: smollm2-135m-instruct "
        "(the default; fetched once) or shakespeare (bundled)",
    )  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--n", type=int, default=1, help="completions, printed one after another")
    parser.add_argument(
        "--echo", action="store_true", help="print the prompt before the completion"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument(
        "--quantize", default="none", choices=QUANTIZATIONS,
        help="int8: int8 layer matrices and head (see gptserve serve)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", *sorted(DTYPES)),
        help="the KV cache's dtype; auto: the model's (see gptserve serve)",
    )  # fmt: skip
    parser.add_argument(
        "--lora", default=None, metavar="DIR",
        help="a PEFT LoRA adapter directory (train.py --lora-rank writes one) to generate with, "
        "on --model as its base",
    )  # fmt: skip
    return parser.parse_args(argv)


def with_adapter(model: GPT, directory: str) -> tuple[LoraBank, LoraAdapter]:
    """One LoRA slot on `model` (loaded for inference) for the adapter at `directory`, and the
    adapter, named after its directory; raises AdapterError (one line) if it cannot be read or
    does not fit the model."""
    adapter = read_adapter(directory, model.config, Path(directory).resolve().name)
    return install_lora(model, 1, adapter.max_rank), adapter


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, max_tokens=args.max_tokens,
        stop=args.stop, n=args.n,
    )  # fmt: skip
    try:
        path = resolve_model(
            args.model, warn=lambda line: print(f"warning: {line}", file=sys.stderr)
        )
        loaded = load_for_inference(
            path, device=args.device, dtype=args.dtype, quantization=args.quantize
        )
        tokenizer = loaded.tokenizer
        config = EngineConfig(
            max_num_seqs=max(1, args.n), kv_cache_dtype=DTYPES.get(args.kv_cache_dtype)
        )
        bank, adapter = with_adapter(loaded.model, args.lora) if args.lora else (None, None)
        engine = Engine(loaded.model, tokenizer, config, lora=bank)
        if adapter is not None:
            engine.adapters.load(adapter.name, adapter)  # checks its shapes
            params = dataclasses.replace(params, lora=adapter.name)
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True) or [tokenizer.eot_token]
        engine.add_request("cli", prompt, params)
    except (ModelLoadError, FetchError, RequestError, RuntimeError,
            ValueError) as exc:  # fmt: skip
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        return _stream(engine, args)
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _stream(engine: Engine, args: argparse.Namespace) -> int:
    """Print the request's completions as they come; 1 if it failed."""
    texts: dict[int, list[str]] = {i: [] for i in range(args.n)}
    while engine.has_work():
        for event in engine.step():
            if event.error:
                print(f"\nerror: {event.error}", file=sys.stderr)
                return 1
            if args.n == 1:
                if args.echo and not texts[0]:
                    sys.stdout.write(args.prompt)
                sys.stdout.write(event.text)
                sys.stdout.flush()
            texts[event.index].append(event.text)
    if args.n > 1:
        for i in range(args.n):
            print(f"--- completion {i} ---")
            print((args.prompt if args.echo else "") + "".join(texts[i]))
    else:
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
