"""Offline generation: stream a completion for a prompt to the terminal through the Engine.

python -m engine --model PATH "To be, or not to be"
"""

from __future__ import annotations

import argparse
import sys

from engine.engine import Engine, EngineConfig
from engine.errors import RequestError
from engine.loader import ModelLoadError, load_for_inference
from engine.sampler import SamplingParams
from model.dtypes import DTYPES
from model.known_models import FetchError, resolve_model
from model.quantize import QUANTIZATIONS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__.split("\n")[0])
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
        help="int8: int8 layer matrices and head (see python -m server)",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=("auto", *sorted(DTYPES)),
        help="the KV cache's dtype; auto: the model's (see python -m server)",
    )  # fmt: skip
    return parser.parse_args(argv)


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
        engine = Engine(loaded.model, tokenizer, config)
        prompt = tokenizer.encode(args.prompt, add_special_tokens=True) or [tokenizer.eot_token]
        engine.add_request("cli", prompt, params)
    except (ModelLoadError, FetchError, RequestError, RuntimeError,
            ValueError) as exc:  # fmt: skip
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
