"""Soak test: many concurrent streaming clients against `gptserve serve` for a fixed time.

    python bench/soak.py [--duration 60] [--clients 64] [--model PATH]

Without --model a small random GPT-2-shaped model (2 layers, width 128, context 256) is saved
to a temporary directory and served. A third of the clients hang up at a random point of each of
their streams; prompts are token-id lists of mixed lengths up to the context limit; temperature,
top-k/p, penalties, n, stop strings, logprobs and seeds vary per request; one request in four
goes to chat completions.

Reports requests completed, errors (goal 0; 429s are counted apart), p95 time to first token,
the server's resident memory (VmRSS from /proc) at start, after warm-up and at the end (goal:
flat after warm-up), and KV cache usage after the run (goal 0). Exit status 1 if a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from bench.host import print_host  # noqa: E402

RSS_GROWTH_LIMIT = 0.10  # after warm-up, growth above this fraction counts as a leak


@dataclass
class Tally:
    completed: int = 0
    disconnected: int = 0  # clients that hung up on purpose
    overloaded: int = 0  # 429 answers
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    error_samples: list[str] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.errors += 1
        if len(self.error_samples) < 5:
            self.error_samples.append(what[:300])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def make_model(directory: Path) -> Path:
    import torch
    from gptserve.model import GPT, ModelConfig, save_checkpoint

    torch.manual_seed(0)
    path = directory / "soak-gpt"
    save_checkpoint(GPT(ModelConfig(n_layer=2, n_head=4, n_embd=128, block_size=256)), path)
    return path


def random_request(rng: random.Random, max_len: int, vocab: int) -> tuple[str, dict]:
    """(path, body) with a prompt length drawn from short, medium and near-the-limit ranges."""
    band = rng.choice(["short", "medium", "long"])
    top = max_len - 2
    plen = {
        "short": rng.randint(1, 16),
        "medium": rng.randint(17, max(17, top // 2)),
        "long": rng.randint(max(1, top - 32), top),
    }[band]
    max_tokens = rng.randint(1, max(1, min(48, max_len - plen - 1)))
    params: dict = {
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": rng.choice([0.0, 0.7, 1.0, 1.3]),
        "top_p": rng.choice([1.0, 0.9, 0.5]),
        "top_k": rng.choice([0, 1, 40]),
        "presence_penalty": rng.choice([0.0, 0.5]),
        "frequency_penalty": rng.choice([0.0, 0.3]),
        "repetition_penalty": rng.choice([1.0, 1.1]),
        "n": rng.choice([1, 1, 1, 2]),
        "ignore_eos": rng.random() < 0.5,
    }
    if rng.random() < 0.3:
        params["seed"] = rng.randint(0, 2**31)
    if rng.random() < 0.3:
        params["stop"] = rng.sample(["\n", ".", " the", "!"], k=rng.randint(1, 2))
    if rng.random() < 0.25:  # chat: the template adds tokens, so keep the text short
        words = " ".join(rng.choice(["hello", "world", "soak", "test"]) for _ in range(plen // 4))
        params["max_tokens"] = min(max_tokens, 32)
        if rng.random() < 0.3:
            params.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        return "/v1/chat/completions", {
            "messages": [{"role": "user", "content": words or "hi"}],
            **params,
        }
    if rng.random() < 0.3:
        params["logprobs"] = rng.randint(0, 5)
    prompt = [rng.randrange(vocab) for _ in range(plen)]
    return "/v1/completions", {"prompt": prompt, **params}


async def one_request(
    client: httpx.AsyncClient, tally: Tally, rng: random.Random, hang_up: bool, max_len: int
) -> None:
    path, body = random_request(rng, max_len, 50257)
    cut_after = rng.randint(0, 8) if hang_up else None
    start = time.perf_counter()
    first = True
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 429:
                tally.overloaded += 1
                await asyncio.sleep(0.2)
                return
            if r.status_code != 200:
                tally.error(f"{r.status_code} {(await r.aread()).decode(errors='replace')}")
                return
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    tally.completed += 1
                    return
                obj = json.loads(data)
                if "error" in obj:
                    tally.error(f"error event {obj['error']}")
                    return
                if first and obj["choices"]:
                    tally.ttft.append(time.perf_counter() - start)
                    first = False
                tally.tokens += 1
                events += 1
                if cut_after is not None and events >= cut_after:
                    tally.disconnected += 1
                    return  # leaving the block closes the connection mid-stream
            tally.error("stream ended without [DONE]")
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
        tally.error(f"{type(exc).__name__}: {exc}")


async def client_loop(
    url: str, index: int, deadline: float, tally: Tally, seed: int, max_len: int
) -> None:
    rng = random.Random(seed * 1000 + index)
    hang_up = index % 3 == 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            await one_request(client, tally, rng, hang_up, max_len)


async def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError("server did not become ready")


def metric(text: str, name: str) -> float:
    """The value of an unlabelled metric in Prometheus text."""
    line = next(x for x in text.splitlines() if x.startswith(name + " "))
    return float(line.split()[-1])


async def after_run(url: str, timeout: float = 10.0) -> tuple[float, float, dict]:
    """KV cache usage ratio and preemptions from /metrics once the server is idle (bounded
    wait), and /health."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while True:
            text = (await client.get(f"{url}/metrics")).text
            usage = metric(text, "gptserve_kv_cache_usage_ratio")
            health = (await client.get(f"{url}/health")).json()
            idle = health.get("running") == 0 and health.get("waiting") == 0
            if (usage == 0 and idle) or time.monotonic() > deadline:
                return usage, metric(text, "gptserve_preemptions_total"), health
            await asyncio.sleep(0.1)


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict:
    async with httpx.AsyncClient(timeout=10) as client:
        max_len = (await client.get(f"{url}/v1/models")).json()["data"][0]["max_model_len"]
    rss = {"start": rss_mib(pid)}
    tally = Tally()
    t0 = time.monotonic()
    deadline = t0 + args.duration
    tasks = [
        asyncio.create_task(client_loop(url, i, deadline, tally, args.seed, max_len))
        for i in range(args.clients)
    ]
    warmup_at = t0 + args.warmup
    peak = rss["start"]
    while not all(t.done() for t in tasks):
        await asyncio.sleep(0.5)
        now = rss_mib(pid)
        peak = max(peak, now)
        if "warm" not in rss and time.monotonic() >= warmup_at:
            rss["warm"] = now
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    usage, preemptions, health = await after_run(url)
    rss["end"] = rss_mib(pid)
    rss.setdefault("warm", rss["end"])
    return {
        "tally": tally,
        "wall": wall,
        "rss": rss,
        "peak": peak,
        "kv_usage": usage,
        "preemptions": preemptions,
        "health": health,
        "max_len": max_len,
    }


def p95(values: list[float]) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[94]


def report(args: argparse.Namespace, r: dict) -> bool:
    t: Tally = r["tally"]
    rss = r["rss"]
    growth = (rss["end"] - rss["warm"]) / rss["warm"]
    rows = [
        ("duration (s)", f"{r['wall']:.1f}", f"{args.duration:g} + drain"),
        ("clients (hang-ups)", f"{args.clients} ({(args.clients + 2) // 3})", ""),
        ("requests completed", str(t.completed), ""),
        ("requests hung up on purpose", str(t.disconnected), ""),
        ("429 overloaded", str(t.overloaded), "counted apart"),
        ("errors", str(t.errors), "0"),
        ("stream chunks received", str(t.tokens), ""),
        ("TTFT p50 (ms)", f"{statistics.median(t.ttft) * 1e3:.0f}" if t.ttft else "-", ""),
        ("TTFT p95 (ms)", f"{p95(t.ttft) * 1e3:.0f}", ""),
        ("RSS at start (MiB)", f"{rss['start']:.0f}", ""),
        (f"RSS after warm-up, {args.warmup:g} s (MiB)", f"{rss['warm']:.0f}", ""),
        ("RSS at end (MiB)", f"{rss['end']:.0f}", f"<= +{RSS_GROWTH_LIMIT:.0%} of warm-up"),
        ("RSS peak (MiB)", f"{r['peak']:.0f}", ""),
        ("RSS growth after warm-up", f"{growth:+.1%}", ""),
        ("KV cache usage after run", f"{r['kv_usage']:.3f}", "0"),
        ("running / waiting after run", f"{r['health']['running']} / {r['health']['waiting']}", ""),
        ("failed engine steps", str(r["health"]["failed_steps"]), "0"),
        ("preemptions (KV pool full)", f"{r['preemptions']:.0f}", ""),
    ]
    width = max(len(a) for a, _, _ in rows)
    print(f"\nsoak: {args.clients} streaming clients, context {r['max_len']} tokens")
    print(f"| {'metric':<{width}} | value | goal |")
    print(f"|{'-' * (width + 2)}|---|---|")
    for name, value, goal in rows:
        print(f"| {name:<{width}} | {value} | {goal} |")
    for sample in t.error_samples:
        print("error sample:", sample)
    ok = (
        t.errors == 0
        and r["kv_usage"] == 0
        and growth <= RSS_GROWTH_LIMIT
        and r["health"]["failed_steps"] == 0
        and t.completed > 0
    )
    print("result:", "PASS" if ok else "FAIL")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=None, help="seconds (default: duration / 4)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--model", help="checkpoint directory (default: a small random model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--log", default=None, help="server log file (default: in a temp dir)")
    args = p.parse_args()
    print_host(bandwidth=False)  # the load's figures are latencies and memory
    if args.warmup is None:
        args.warmup = args.duration / 4
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else make_model(Path(tmp))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log_path = Path(args.log) if args.log else Path(tmp) / "server.log"
        cmd = [
            sys.executable, "-m", "gptserve.server", "--model", str(model), "--port", str(port),
            "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning",
        ]  # fmt: skip
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            asyncio.run(wait_ready(url, proc))
            result = asyncio.run(soak(args, url, proc.pid))
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"command: {' '.join(cmd)}")
        ok = report(args, result)
        if not ok or proc.returncode != 0:
            print(f"server exit status {proc.returncode}; log tail:")
            print("".join(log_path.read_text().splitlines(keepends=True)[-20:]))
    return 0 if ok and proc.returncode == 0 else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
