"""Fair admission between API keys: another key's stream while one key sends its largest request.

    python bench/fairness.py [--model NAME|PATH] [--input-tokens 8000] [--rounds 3] [--late 20]

Starts `gptserve serve` with two API keys. Key B's chat stream (48 new tokens, greedy) is timed
alone, then while key A sends the worst request the limits admit: 16 inputs of --input-tokens
token ids each to /v1/embeddings, then the same 16 as prompts to /v1/completions, B's stream
sent 1 s after A's request, and once more --late seconds after (A's prompts deep in, where each
of their tokens costs most). Prints the host, every round, then for each case the best and the
worst of --rounds against the goal (first token within 2 s, the stream within 3x its time alone,
the worst round against the median alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from bench.host import print_host  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402

KEY_A, KEY_B = "bench-bulk", "bench-chat"
QUESTION = "Write a short poem about the sea."


def victim(url: str) -> tuple[float, float]:
    """B's stream: seconds to the first token and to the end."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 48,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    start, first = time.perf_counter(), None
    headers = {"Authorization": f"Bearer {KEY_B}"}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers,
                      timeout=1800) as r:  # fmt: skip
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = first or time.perf_counter()
    return (first or time.perf_counter()) - start, time.perf_counter() - start


BULK = """
import json, sys, httpx
url, endpoint, tokens, key = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
inputs = [[200 + i] * tokens for i in range(16)]
body = {"input": inputs} if endpoint == "embeddings" else {"prompt": inputs, "max_tokens": 1}
r = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=3600,
               headers={"Authorization": f"Bearer {key}"})
print(r.status_code, r.text[:200])
"""


def under_attack(url: str, endpoint: str, tokens: int, after: float) -> tuple[float, float]:
    """B's stream sent `after` seconds into A's request; A's request is cut off after (its
    process killed: the server aborts what a closed connection asked for), so each case starts
    from an idle server."""
    bulk = subprocess.Popen([sys.executable, "-c", BULK, url, endpoint, str(tokens), KEY_A],
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(after)  # A's request is in and running
    result = victim(url)
    if bulk.poll() is not None:
        print(f"  note: {endpoint} ended before the stream: {bulk.stdout.read()}", flush=True)
    bulk.kill()
    bulk.wait()
    while httpx.get(f"{url}/health", timeout=10).json().get("running", 0):
        time.sleep(0.2)  # the aborted sequences leave
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--input-tokens", type=int, default=8000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--late", type=float, default=20.0, help="seconds into A's request (0: skip)")
    args = p.parse_args()
    print_host()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args.model, port, "--api-key", KEY_A, "--api-key", KEY_B)
    tokens = args.input_tokens
    cases: list[tuple[str, Callable[[], tuple[float, float]]]] = [
        ("alone", lambda: victim(url)),
        ("with 16 x embeddings", lambda: under_attack(url, "embeddings", tokens, 1.0)),
        ("with 16 x completions", lambda: under_attack(url, "completions", tokens, 1.0)),
    ]
    if args.late:
        cases.append((f"with 16 x completions, {args.late:g} s in",
                      lambda: under_attack(url, "completions", tokens, args.late)))  # fmt: skip
    try:
        victim(url)  # warm-up
        rows: dict[str, list[tuple[float, float]]] = {}
        for i in range(args.rounds):
            for name, run in cases:
                first, total = run()
                rows.setdefault(name, []).append((first, total))
                print(f"  round {i + 1}, {name}: first token {first:.2f} s, stream {total:.2f} s",
                      flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(60)
    alone = statistics.median(total for _, total in rows["alone"])
    print(f"\n{args.model}, B's 48-token stream over {args.rounds} rounds (goal: first token "
          "<= 2 s, stream <= 3x alone)\n")  # fmt: skip
    print("| case | first token, best / worst (s) | stream, best / worst (s) | worst / alone |")
    print("|---|---|---|---|")
    for name, samples in rows.items():
        firsts, totals = [f for f, _ in samples], [t for _, t in samples]
        print(f"| {name} | {min(firsts):.2f} / {max(firsts):.2f} | {min(totals):.2f} / "
              f"{max(totals):.2f} | {max(totals) / alone:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()
