"""Several models on one server: the cost of a cold load, of a swap, and the memory an unload
gives back.

    python bench/multi_model.py [--warm 5] [--swaps 6] [--cycles 3] [--max-tokens 8]

Serves two models on one `gptserve serve` (the bundled `shakespeare` and, where its file is
cached, the default SmolLM2-135M-Instruct GGUF file; else `shakespeare` twice under two names)
and measures, in the same run:
- each model's first token on its first request (a cold load: the request waits for the load)
  against its first token once loaded (warm, the median of --warm requests: the baseline);
- a second server with --max-loaded-models 1, requests alternating between the two models: each
  one unloads the other model and loads its own (a swap), against the same server's warm first
  token;
- the server's resident memory (VmRSS) with nothing loaded, after each load and after each
  unload (Ollama's keep_alive 0), over --cycles load/unload cycles of both models.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.model import SHAKESPEARE_DIR  # noqa: E402
from gptserve.model.known_models import DEFAULT_MODEL_NAME, cached_path  # noqa: E402

from bench.host import print_host  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402
from bench.soak import rss_mib  # noqa: E402

PROMPT = "ROMEO: What light through yonder window breaks?"


def first_token(url: str, model: str, max_tokens: int) -> float:
    """Seconds from sending a streamed completion to its first text chunk."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
    started = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise SystemExit(f"{model}: HTTP {r.status_code}: {r.read().decode()}")
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.perf_counter() - started
    raise SystemExit(f"{model}: no token came")


def unload(url: str, model: str) -> None:
    """Ollama's way: an empty generate with keep_alive 0; returns once the model is gone."""
    httpx.post(f"{url}/api/generate", json={"model": model, "keep_alive": 0}, timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if model not in [
            m["name"] for m in httpx.get(f"{url}/api/ps", timeout=10).json()["models"]
        ]:
            return
        time.sleep(0.05)
    raise SystemExit(f"{model} did not unload")


def models() -> list[tuple[str, str]]:
    """(name, --model flag) of the two models."""
    gguf = cached_path(DEFAULT_MODEL_NAME)
    second = (DEFAULT_MODEL_NAME, f"{DEFAULT_MODEL_NAME}={gguf}") if gguf.is_file() else (
        "shakespeare-2", f"shakespeare-2={SHAKESPEARE_DIR}"
    )  # fmt: skip
    return [("shakespeare", "shakespeare"), second]


def serve(pair: list[tuple[str, str]], *flags: str):  # noqa: ANN201
    port = free_port()
    proc = start_server(pair[0][1], port, "--model", pair[1][1], *flags)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--warm", type=int, default=5, help="warm requests per model (the median)")
    p.add_argument("--swaps", type=int, default=6, help="alternating requests, one loaded")
    p.add_argument("--cycles", type=int, default=3, help="load/unload cycles for the memory")
    p.add_argument("--max-tokens", type=int, default=8)
    args = p.parse_args()
    print_host()
    pair = models()
    names = [n for n, _ in pair]
    print(f"models: {', '.join(f'{n} ({f})' for n, f in pair)}\n")

    proc, url = serve(pair)
    try:
        rss = [("nothing loaded", rss_mib(proc.pid))]
        cold, warm = {}, {}
        for name in names:
            cold[name] = first_token(url, name, args.max_tokens)
            rss.append((f"{name} loaded", rss_mib(proc.pid)))
            warm[name] = statistics.median(
                first_token(url, name, args.max_tokens) for _ in range(args.warm)
            )
        for cycle in range(args.cycles):
            for name in names:
                unload(url, name)
                rss.append((f"cycle {cycle + 1}: {name} unloaded", rss_mib(proc.pid)))
            if cycle + 1 < args.cycles:
                for name in names:
                    first_token(url, name, args.max_tokens)
                rss.append((f"cycle {cycle + 2}: both loaded", rss_mib(proc.pid)))
    finally:
        proc.terminate()
        proc.wait(30)

    proc, url = serve(pair, "--max-loaded-models", "1")
    try:
        first_token(url, names[0], args.max_tokens)  # the first load is not a swap
        warm_one = statistics.median(
            first_token(url, names[0], args.max_tokens) for _ in range(args.warm)
        )
        swaps = [first_token(url, names[(i + 1) % 2], args.max_tokens) for i in range(args.swaps)]
    finally:
        proc.terminate()
        proc.wait(30)

    print("| model | cold first token (s) | warm first token (s) | cold / warm |")
    print("|---|---|---|---|")
    for name in names:
        print(f"| {name} | {cold[name]:.2f} | {warm[name]:.3f} | {cold[name] / warm[name]:.0f}x |")
    print()
    print("| --max-loaded-models 1, alternating | first token (s) |")
    print("|---|---|")
    print(f"| warm (no swap, median of {args.warm}) | {warm_one:.3f} |")
    print(f"| swap (median of {args.swaps}) | {statistics.median(swaps):.2f} |")
    print(f"| swap (max) | {max(swaps):.2f} |")
    print()
    print("| server state | resident memory (MiB) |")
    print("|---|---|")
    for what, mib in rss:
        print(f"| {what} | {mib:.0f} |")
    base = rss[0][1]
    unloaded = [mib for what, mib in rss if what.endswith(f"{names[-1]} unloaded")]
    print(
        f"\nafter unloading both: {unloaded[0] - base:+.0f} MiB over nothing loaded (first "
        f"cycle), {unloaded[-1] - base:+.0f} MiB (last of {args.cycles})"
    )


if __name__ == "__main__":
    main()
