"""The headline table: `gptserve serve` over HTTP against a native llama.cpp build, same file.

    python bench/vs_llamacpp.py                         # the default model's own GGUF file
    python bench/vs_llamacpp.py --gguf FILE --rounds 3 --threads 2

gptserve runs as a user starts it (`gptserve serve --model FILE`, its defaults) and is measured
as a client sees it, over HTTP with streaming; llama.cpp runs its own tools (`llama-bench`,
`llama-batched-bench`) from a build for this host (bench/llamacpp_native.py finds or, with
--build, makes it). Rows, both sides in every round, which side goes first alternating:

- one stream, 64 new tokens: gptserve's rate between its first and last streamed token (the
  prompt's prefill left out, as llama-bench's tg64 leaves it out);
- a 512-token prompt: 512 / the time to the first token of a fresh 512-token prompt (its own
  random ids each round, so no prefix cache helps) against llama-bench's pp512;
- 16 and 32 streams of 64 + 64 tokens, all sent at once: the wall time of the whole batch
  against llama-batched-bench's; and the batch's new tokens per second over llama.cpp's
  single stream.

Prompts are random ids of the file's vocabulary; every request ignores end-of-sequence so that
each produces exactly its tokens. The table keeps each side's median.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from gptserve.model.known_models import resolve_model  # noqa: E402

from bench.host import print_host  # noqa: E402
from bench.llamacpp_native import NativeBuild, batched, build_native, find_native, tg_pp  # noqa: E402
from bench.serve import free_port  # noqa: E402
from bench.serve import start_server as _start_server  # noqa: E402

DEFAULT_MODEL = "smollm2-135m-instruct"


async def stream_once(client: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      new: int) -> tuple[float, float, int]:  # fmt: skip
    """(time of the first streamed token, of the last, tokens seen) of one completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    first = last = 0.0
    seen = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise SystemExit(f"gptserve answered {response.status_code}: {await response.aread()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0]["text"] is not None:
                last = time.perf_counter()
                first = first or last
                seen += 1
    return first, last, seen


async def gptserve_round(
    url: str, vocab: int, rng: random.Random, streams: tuple[int, ...]
) -> dict:
    """One round of every gptserve measurement."""
    ids = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    out: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        first, last, seen = await stream_once(client, url, model, ids(8), 64)
        out["tg64"] = (seen - 1) / (last - first)
        started = time.perf_counter()
        first, _, _ = await stream_once(client, url, model, ids(512), 1)
        out["pp512"] = 512 / (first - started)
        for n in streams:
            started = time.perf_counter()
            await asyncio.gather(*(stream_once(client, url, model, ids(64), 64) for _ in range(n)))
            out[f"x{n}"] = time.perf_counter() - started
    return out


def llamacpp_round(build: NativeBuild, gguf: Path, threads: int, streams: tuple[int, ...]) -> dict:
    out = dict(tg_pp(build, gguf, threads, repetitions=1))
    for n in streams:
        out[f"x{n}"] = batched(build, gguf, threads, n)
    return out


def vocab_size(gguf: Path) -> int:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", default=DEFAULT_MODEL, help="a GGUF file or a known model's name")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--streams", default="16,32", help="batch sizes of the batched rows")
    p.add_argument("--build", action="store_true", help="build llama.cpp when none is found")
    p.add_argument("--serve-flag", action="append", default=[], help="one more `serve` flag")
    args = p.parse_args()
    print_host()
    gguf = Path(args.gguf) if Path(args.gguf).is_file() else resolve_model(args.gguf)
    build = find_native() or (build_native() if args.build else None)
    if build is None:
        sys.exit("no native llama.cpp build: bash bench/build_llamacpp.sh, or pass --build")
    streams = tuple(int(s) for s in args.streams.split(",") if s)
    vocab, rng = vocab_size(gguf), random.Random(0)
    port = free_port()
    flags = [f.strip() for flag in args.serve_flag for f in flag.split()]
    server = _start_server(gguf, port, *flags)
    ours: list[dict] = []
    theirs: list[dict] = []
    try:
        asyncio.run(gptserve_round(f"http://127.0.0.1:{port}", vocab, rng, (2,)))  # warm-up
        for r in range(args.rounds):
            sides = [
                lambda: ours.append(asyncio.run(
                    gptserve_round(f"http://127.0.0.1:{port}", vocab, rng, streams))),
                lambda: theirs.append(llamacpp_round(build, gguf, args.threads, streams)),
            ]  # fmt: skip
            for side in sides if r % 2 == 0 else sides[::-1]:
                side()
    finally:
        server.terminate()
        server.wait(30)
    med = lambda rows, key: statistics.median(row[key] for row in rows)  # noqa: E731
    print(f"\nfile {gguf.name}; {build.describe()}; gptserve over HTTP; {args.threads} threads; "
          f"median of {args.rounds} rounds\n")  # fmt: skip
    print("| | llama.cpp | gptserve | ratio |\n|---|---|---|---|")
    single = med(theirs, "tg64")
    for key, label in (("tg64", "one stream, 64 new tokens"), ("pp512", "a 512-token prompt")):
        a, b = med(theirs, key), med(ours, key)
        print(f"| {label} (tok/s) | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    for n in streams:
        a, b = med(theirs, f"x{n}"), med(ours, f"x{n}")
        rate = n * 64 / b
        print(f"| {n} streams, 64+64 each (s) | {a:.2f} | {b:.2f} | {a / b:.2f}x; "
              f"{rate:.0f} new tok/s = {rate / single:.2f}x llama.cpp's single stream |")  # fmt: skip


if __name__ == "__main__":
    main()
