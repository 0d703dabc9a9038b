"""Serving benchmark: streaming load at several concurrencies against `gptserve serve`, and the
server's tok/s at concurrency 1 against the Engine run offline in this process on the same model.

    python bench/serve.py [--model PATH] [--max-tokens 32] [--concurrency 1 8 32]

Without --model a randomly initialised GPT-2 124M is saved to a temporary directory and served.
Prints TTFT and inter-token latency (p50/p95), aggregate tok/s and errors per concurrency, then
the HTTP+SSE overhead as server tok/s / offline tok/s at concurrency 1 (goal: >= 0.90), the two
measured in alternating rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import load_for_inference  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model import GPT, ModelConfig, get_tokenizer, save_checkpoint  # noqa: E402
from gptserve.model.cpu.malloc_tuning import retain_freed_memory  # noqa: E402

from bench.host import print_host  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass
class Level:
    concurrency: int
    requests: int
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0
    wall: float = 0.0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return (
        statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]
        if len(values) > 1
        else values[0]
    )


class Offline:
    """The Engine alone in this process, one request at a time, same prompt and length as the
    server run."""

    def __init__(self, path: Path, max_tokens: int) -> None:
        loaded = load_for_inference(path, device="cpu")  # as `gptserve serve` loads it
        self.tok = loaded.tokenizer
        self.engine = Engine(loaded.model, self.tok, EngineConfig(max_num_seqs=32))
        self.ids = self.tok.encode(PROMPT)
        self.params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=1.0)
        self.runs = 0
        self.rate(1)  # warm-up

    def rate(self, requests: int) -> float:
        t0, tokens = time.perf_counter(), 0
        for _ in range(requests):
            self.runs += 1
            self.engine.add_request(f"r{self.runs}", self.ids, self.params)
            while self.engine.has_work():
                tokens += sum(len(e.token_ids) for e in self.engine.step())
        return tokens / (time.perf_counter() - t0)


async def one_request(client: httpx.AsyncClient, level: Level, max_tokens: int) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                level.errors += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    level.errors += 1
                    return
                now = time.perf_counter()
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    if last is None:
                        level.ttft.append(now - start)
                    else:
                        level.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    level.tokens += chunk["usage"]["completion_tokens"]
    except httpx.HTTPError:
        level.errors += 1


async def run_level(url: str, level: Level, max_tokens: int) -> None:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(level.requests):
        queue.put_nowait(i)

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            queue.get_nowait()
            await one_request(client, level, max_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(level.concurrency)))
        level.wall = time.perf_counter() - t0


def start_server(path: str | Path, port: int, *flags: str) -> subprocess.Popen:
    """`gptserve serve` on 127.0.0.1:port with more flags; returns once it serves."""
    cmd = [sys.executable, "-m", "gptserve.server", "--model", str(path), "--port", str(port),
           "--max-num-seqs", "32", "--log-level", "warning", *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become ready")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint dir (default: random GPT-2 124M)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds for the ratio")
    args = p.parse_args()
    print_host()
    tmp = None
    path = args.model
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "gpt2-124m-random"
        torch.manual_seed(0)
        save_checkpoint(GPT(ModelConfig()), path)
    levels = [Level(c, max(4, c if c >= 8 else 4 * c)) for c in args.concurrency]
    retain_freed_memory()  # as `gptserve serve` does
    offline = Offline(path, args.max_tokens)
    port = free_port()
    proc = start_server(path, port)
    try:
        url = f"http://127.0.0.1:{port}"
        asyncio.run(run_level(url, Level(1, 1), args.max_tokens))  # warm-up
        for level in levels:
            asyncio.run(run_level(url, level, args.max_tokens))
        # the ratio: the two sides alternate and each keeps its best round, so a slow spell on a
        # shared machine does not land on one side only
        requests = 4
        offline_best = served_best = 0.0
        ratio_errors = 0
        for _ in range(args.rounds):
            offline_best = max(offline_best, offline.rate(requests))
            one = Level(1, requests)
            asyncio.run(run_level(url, one, args.max_tokens))
            ratio_errors += one.errors
            served_best = max(served_best, one.tokens / one.wall)
    finally:
        proc.terminate()
        proc.wait(60)
        if tmp is not None:
            tmp.cleanup()

    print(f"\nmodel {path.name if args.model else 'GPT-2 124M (random)'}, {args.max_tokens} tokens/request, "
          f"prompt {len(get_tokenizer().encode(PROMPT))} tokens, torch threads {torch.get_num_threads()}")  # fmt: skip
    print(
        f"{'conc':>5} {'reqs':>5} {'TTFT p50':>9} {'TTFT p95':>9} {'ITL p50':>8} {'ITL p95':>8} {'tok/s':>7} {'errors':>6}"
    )
    for lv in levels:
        ms = [
            1000 * pct(lv.ttft, 50),
            1000 * pct(lv.ttft, 95),
            1000 * pct(lv.itl, 50),
            1000 * pct(lv.itl, 95),
        ]
        print(f"{lv.concurrency:>5} {lv.requests:>5} {ms[0]:>7.1f}ms {ms[1]:>7.1f}ms {ms[2]:>6.1f}ms "
              f"{ms[3]:>6.1f}ms {lv.tokens / lv.wall:>7.1f} {lv.errors:>6}")  # fmt: skip
    print(f"\nconcurrency 1, best of {args.rounds} alternating rounds of {requests} requests: server "
          f"{served_best:.1f} tok/s vs offline engine {offline_best:.1f} tok/s -> ratio "
          f"{served_best / offline_best:.3f} (goal >= 0.90), {ratio_errors} errors")  # fmt: skip


if __name__ == "__main__":
    main()
