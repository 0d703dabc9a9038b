"""Ray Serve replicas: aggregate tok/s with 1 and 2 replicas, and what Ray costs against plain
`gptserve serve`, on the same model and load.

    python bench/replicas.py [--model PATH] [--max-tokens 64] [--concurrency 16] [--rounds 3]
                             [--stream-interval 4]

Needs the `ray` extra. Without --model a randomly initialised GPT-2 124M is saved to a temporary
directory. Three servers run side by side: `gptserve serve` (the baseline, using every core),
and one local Ray with two applications: `/one`, one replica that reserves every core, and
`/two`, two replicas that reserve half each (Ray gives a replica as many torch threads as CPUs).
Each round sends the same streaming load (--concurrency clients, --requests completions of
--max-tokens tokens) to each of the three in turn, and each keeps its best round, so a slow spell
on a shared machine does not land on one side only. Prints tok/s and TTFT p50 for each, then Ray's
overhead (1 replica under Ray / plain; goal: >= 0.90) and the 2-replica scaling (2 / 1).
--stream-interval is given to all three servers alike (tokens per SSE chunk after the first).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from gptserve.model import GPT, ModelConfig, save_checkpoint  # noqa: E402

from bench.host import print_host  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. " * 4


@dataclass
class Load:
    """One round against one server."""

    tokens: int = 0
    errors: int = 0
    wall: float = 0.0
    ttft: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.wall if self.wall else 0.0


async def one_request(client: httpx.AsyncClient, load: Load, max_tokens: int) -> None:
    body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, first = time.perf_counter(), True
    try:
        async with client.stream("POST", "v1/completions", json=body) as r:
            if r.status_code != 200:
                load.errors += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    load.errors += 1
                    return
                if first and chunk["choices"]:
                    load.ttft.append(time.perf_counter() - start)
                    first = False
                if chunk.get("usage"):
                    load.tokens += chunk["usage"]["completion_tokens"]
    except httpx.HTTPError:
        load.errors += 1


async def run_load(url: str, concurrency: int, requests: int, max_tokens: int) -> Load:
    load = Load()
    left = list(range(requests))

    async def worker(client: httpx.AsyncClient) -> None:
        while left:
            left.pop()
            await one_request(client, load, max_tokens)

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        load.wall = time.perf_counter() - t0
    return load


def start_ray(path: Path, port: int, cores: int, kv_cache_gb: float, stream_interval: int) -> None:
    """A local Ray with `/one` (1 replica, every core) and `/two` (2 replicas, half each)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's token authentication with a token of this run's (none is written to ~/.ray)
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    import ray
    from gptserve.server.ray.deployment import ScaleOptions, deployment
    from gptserve.server.ray.proxy_middleware import PROXY_CALLBACK, PROXY_CALLBACK_ENV
    from gptserve.server.settings import Settings
    from ray import serve

    os.environ.setdefault(PROXY_CALLBACK_ENV, PROXY_CALLBACK)
    # both applications at once: 2 x `cores` CPUs declared, one of them busy at a time
    ray.init(address="local", num_cpus=2 * cores, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    settings = Settings(
        model=str(path), max_num_seqs=32, kv_cache_gb=kv_cache_gb, log_level="warning",
        stream_interval=stream_interval,
    )  # fmt: skip
    for name, replicas in (("one", 1), ("two", 2)):
        options = ScaleOptions(num_replicas=replicas, num_cpus=cores / replicas)
        serve.run(deployment(settings, options), name=name, route_prefix=f"/{name}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, help="checkpoint dir (default: random GPT-2 124M)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=16, help="completions per round and server")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument(
        "--kv-cache-gb", type=float, default=0.25, help="each server's KV cache (4 are loaded)"
    )
    p.add_argument(
        "--stream-interval", type=int, default=4,
        help="every server's, alike (default: the Ray deployment's; 1 streams every token)",
    )  # fmt: skip
    args = p.parse_args()
    print_host()
    cores = os.cpu_count() or 1
    tmp = None
    path = args.model
    if path is None:
        tmp = tempfile.TemporaryDirectory()
        path = Path(tmp.name) / "gpt2-124m-random"
        torch.manual_seed(0)
        save_checkpoint(GPT(ModelConfig()), path)
    load_before = os.getloadavg()[0]
    plain_port, ray_port = free_port(), free_port()
    proc = start_server(path, plain_port, "--kv-cache-gb", str(args.kv_cache_gb),
                        "--stream-interval", str(args.stream_interval))  # fmt: skip
    try:
        start_ray(path, ray_port, cores, args.kv_cache_gb, args.stream_interval)
        urls = {
            "gptserve serve": f"http://127.0.0.1:{plain_port}/",
            "Ray Serve, 1 replica": f"http://127.0.0.1:{ray_port}/one/",
            "Ray Serve, 2 replicas": f"http://127.0.0.1:{ray_port}/two/",
        }
        threads = {  # replicas x torch threads each
            "gptserve serve": f"1 x {torch.get_num_threads()}",
            "Ray Serve, 1 replica": f"1 x {cores}",
            "Ray Serve, 2 replicas": f"2 x {max(cores // 2, 1)}",
        }
        for url in urls.values():  # warm-up
            asyncio.run(run_load(url, 2, 2, 8))
        best: dict[str, Load] = {name: Load() for name in urls}
        errors = dict.fromkeys(urls, 0)
        for _ in range(args.rounds):
            for name, url in urls.items():
                load = asyncio.run(run_load(url, args.concurrency, args.requests, args.max_tokens))
                errors[name] += load.errors
                if load.rate > best[name].rate:
                    best[name] = load
    finally:
        proc.terminate()
        proc.wait(60)
        try:
            from ray import serve

            serve.shutdown()
            import ray

            ray.shutdown()
        except ImportError:
            pass
        if tmp is not None:
            tmp.cleanup()

    model = path.name if args.model else "GPT-2 124M (random)"
    print(f"\nmodel {model}, {cores} cores, {args.concurrency} streaming clients, "
          f"{args.requests} x {args.max_tokens} tokens per round, best of {args.rounds} rounds, "
          f"KV cache {args.kv_cache_gb:g} GiB per server, stream interval "
          f"{args.stream_interval}")  # fmt: skip
    print(f"load average (1 min) {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print(f"{'server':<24} {'replicas x threads':>18} {'tok/s':>8} {'TTFT p50':>9} {'errors':>6}")
    for name, load in best.items():
        ttft = 1000 * statistics.median(load.ttft) if load.ttft else float("nan")
        print(f"{name:<24} {threads[name]:>18} {load.rate:>8.1f} {ttft:>7.0f}ms {errors[name]:>6}")
    plain, one, two = (best[name].rate for name in urls)
    print(f"\nRay overhead: 1 replica / gptserve serve = {one / plain:.3f} (goal >= 0.90)")
    print(f"2 replicas / 1 replica = {two / one:.2f}")


if __name__ == "__main__":
    main()
