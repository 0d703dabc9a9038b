"""Prefix caching on a multi-turn chat workload: the same server with the cache on and off.

    python bench/prefix.py [--conversations 8] [--turns 6] [--system-tokens 1024]

8 conversations talk to `gptserve serve` at once, 6 turns each; every conversation opens with
the same ~1k-token system prompt (Shakespeare from data/), and each turn resends the whole
conversation, as chat clients do. The server is started twice in this run, once with
`--no-prefix-cache`, on a randomly initialised GPT-2 124M with a 2048-token context. Greedy
answers of 32 tokens. Prints time to first token (p50 for turn 1 and for later turns) and total
generated tokens/s for both, their ratios, and whether every answer was the same. Last, one
more conversation talks to each server by itself for two turns: its second turn's time to first
token, with no other conversation's steps to wait behind.
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

from gptserve.model import GPT, ModelConfig, get_tokenizer, save_checkpoint  # noqa: E402

from bench.host import print_host  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402

CORPUS = REPO / "data" / "shakespeare.txt"


@dataclass
class Run:
    ttft: dict[int, list[float]] = field(default_factory=dict)  # turn -> seconds
    answers: dict[int, list[str]] = field(default_factory=dict)  # conversation -> answers
    tokens: int = 0
    cached: int = 0
    prompt_tokens: int = 0
    wall: float = 0.0
    errors: int = 0


def workload(system_tokens: int, conversations: int, turns: int) -> tuple[str, list[list[str]]]:
    """The shared system prompt and each conversation's user messages, from the corpus."""
    tok = get_tokenizer()
    text = CORPUS.read_text()
    system = tok.decode(tok.encode(text[: 8 * system_tokens])[:system_tokens])
    lines = [line.strip() for line in text[200_000:400_000].splitlines() if len(line.strip()) > 30]
    users = [[lines[c * turns + t] for t in range(turns)] for c in range(conversations)]
    return system, users


async def conversation(
    client: httpx.AsyncClient, index: int, system: str, users: list[str], max_tokens: int, run: Run
) -> None:
    messages = [{"role": "system", "content": system}]
    answers: list[str] = []
    for turn, user in enumerate(users, start=1):
        messages.append({"role": "user", "content": user})
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        start, first, parts = time.perf_counter(), None, []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                run.errors += 1
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    run.errors += 1
                    return
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter()
                    parts.append(chunk["choices"][0]["delta"]["content"])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    run.tokens += usage["completion_tokens"]
                    run.prompt_tokens += usage["prompt_tokens"]
                    run.cached += usage["prompt_tokens_details"]["cached_tokens"]
        run.ttft.setdefault(turn, []).append((first or time.perf_counter()) - start)
        answers.append("".join(parts))
        messages.append({"role": "assistant", "content": answers[-1]})
    run.answers[index] = answers


async def drive(url: str, system: str, users: list[list[str]], max_tokens: int) -> Run:
    run = Run()
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        t0 = time.perf_counter()
        await asyncio.gather(
            *(conversation(client, i, system, u, max_tokens, run) for i, u in enumerate(users))
        )
        run.wall = time.perf_counter() - t0
    return run


def serve_and_drive(
    path: Path, flags: list[str], system: str, users, alone: list[str], max_tokens: int
) -> tuple[Run, Run]:
    """The conversations at once, then one more conversation (`alone`) by itself."""
    port = free_port()
    proc = start_server(path, port, *flags)
    url = f"http://127.0.0.1:{port}"
    try:
        return (
            asyncio.run(drive(url, system, users, max_tokens)),
            asyncio.run(drive(url, system, [alone], max_tokens)),
        )
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--n-head", type=int, default=12)
    args = p.parse_args()
    print_host()
    system, users = workload(args.system_tokens, args.conversations + 1, args.turns)
    users, alone = users[:-1], users[-1][:2]  # the last: two turns by itself, after the rest
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpt2-random-2k"
        torch.manual_seed(0)
        config = ModelConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                             block_size=2048)  # fmt: skip
        save_checkpoint(GPT(config), path)
        both = {
            "cache off": serve_and_drive(
                path, ["--no-prefix-cache"], system, users, alone, args.max_tokens
            ),
            "cache on": serve_and_drive(path, [], system, users, alone, args.max_tokens),
        }
    runs = {name: pair[0] for name, pair in both.items()}
    lone = {name: pair[1].ttft[2][0] for name, pair in both.items() if 2 in pair[1].ttft}

    print(f"\n{args.conversations} conversations x {args.turns} turns, a {args.system_tokens}-token "
          f"system prompt shared by all, {args.max_tokens}-token greedy answers, model "
          f"{args.n_layer}x{args.n_embd} (random), torch threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'':10s} {'TTFT p50 turn 1':>16s} {'turn 2':>9s} {'turns 2+':>9s} {'tok/s':>7s} "
          f"{'cached prompt':>14s} {'wall s':>7s} {'errors':>6s}")  # fmt: skip
    p50 = {}
    for name, run in runs.items():
        later = [t for turn, ts in run.ttft.items() if turn > 1 for t in ts]
        p50[name] = (
            statistics.median(run.ttft.get(1, [float("nan")])),
            statistics.median(run.ttft.get(2, [float("nan")])),
            statistics.median(later or [float("nan")]),
        )
        share = run.cached / max(run.prompt_tokens, 1)
        print(f"{name:10s} {1000 * p50[name][0]:14.0f}ms {1000 * p50[name][1]:7.0f}ms "
              f"{1000 * p50[name][2]:7.0f}ms {run.tokens / run.wall:7.1f} {share:13.1%} "
              f"{run.wall:7.1f} {run.errors:6d}")  # fmt: skip
    off, on = runs["cache off"], runs["cache on"]
    same = off.answers == on.answers and not off.errors and not on.errors
    print(f"\nsecond-turn TTFT: {p50['cache off'][1] / p50['cache on'][1]:.1f}x lower with the cache "
          f"(goal >= 5x); throughput {(on.tokens / on.wall) / (off.tokens / off.wall):.2f}x "
          f"(goal >= 2x); greedy answers identical: {'yes' if same else 'NO'}")  # fmt: skip
    if len(lone) == 2:
        print(f"one more conversation by itself afterwards: second-turn TTFT "
              f"{1000 * lone['cache off']:.0f} ms off, {1000 * lone['cache on']:.0f} ms on, "
              f"{lone['cache off'] / lone['cache on']:.1f}x lower")  # fmt: skip


if __name__ == "__main__":
    main()
