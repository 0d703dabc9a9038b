"""Resident memory of the default start: `gptserve serve` on the default model, then chats.

    python bench/memory.py [--chats 5] [--max-tokens 128]

Starts the server with the default model and settings (SmolLM2-135M-Instruct's Q4_1 GGUF file,
fetched once and named by its path; `bench.serve.start_server`), reads the process's resident
size (VmRSS) once it is healthy and after each of `--chats` distinct chat requests, and prints
them against the budget of issue "safe to expose" (1.5 x the file + 350 MB). In the same run it
measures two baselines on the same file and chats: the server with the old 2 GiB pool
(`--kv-cache-gb 2`), and, where llama-cpp-python is installed (`pip install -e '.[bench]'`),
llama.cpp (its low-level API, as bench/llamacpp.py drives it) holding the model's full
8192-token context.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.model.known_models import DEFAULT_MODEL_NAME, fetch_known_model  # noqa: E402

from bench.host import print_host  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402
from bench.soak import rss_mib  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.",
    "List three rivers in Europe.",
    "What is 12 times 7?",
    "Name a famous painter and one of their works.",
    "How do bees make honey?",
    "Give me a tip for learning to code.",
]
LLAMA_CHILD = """
import json, sys
sys.path.append(sys.argv[4])
from bench.llamacpp import LlamaCpp
from gptserve.model.tokenizers import load_tokenizer
path, max_tokens, questions = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) / 1024
tok = load_tokenizer("gguf", path)
llm = LlamaCpp(path, 2, n_seq=1, n_ctx_seq=8192)  # the model's full context, as llama-server
seen = [rss()]
for q in questions:
    text = "<|im_start|>user\\n" + q + "<|im_end|>\\n<|im_start|>assistant\\n"
    llm.generate([tok.encode(text, allow_special=True)], max_tokens)
    seen.append(rss())
llm.close()
print(json.dumps(seen))
"""


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def server_side(path: Path, flags: list[str], questions: list[str], max_tokens: int) -> list[float]:
    """VmRSS (MiB) of `gptserve serve --model PATH FLAGS` once healthy, then after each chat
    (`--model` the default model's cached file: the default start's model and settings)."""
    port = free_port()
    proc = start_server(path, port, *flags)
    try:
        seen = [rss_mib(proc.pid)]
        for q in questions:
            body = {"messages": [{"role": "user", "content": q}], "max_tokens": max_tokens,
                    "temperature": 0}  # fmt: skip
            post(f"http://127.0.0.1:{port}/v1/chat/completions", body)
            seen.append(rss_mib(proc.pid))
        return seen
    finally:
        proc.terminate()
        proc.wait(60)


def llama_side(path: Path, questions: list[str], max_tokens: int) -> list[float] | str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return None
    done = subprocess.run(
        [sys.executable, "-c", LLAMA_CHILD, str(path), str(max_tokens), json.dumps(questions),
         str(REPO)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    if done.returncode != 0:  # a llama.cpp build this CPU cannot run (seen: AMX hosts)
        print(f"llama.cpp failed (exit {done.returncode}): {done.stderr.strip()[-300:]}")
        return "failed"
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    print_host(bandwidth=False)
    path = fetch_known_model(DEFAULT_MODEL_NAME)
    file_mb = path.stat().st_size / 1e6
    budget_mb = 1.5 * file_mb + 350
    questions = (QUESTIONS * (args.chats // len(QUESTIONS) + 1))[: args.chats]
    rows = [
        ("gptserve, default start", server_side(path, [], questions, args.max_tokens)),
        (
            "gptserve --kv-cache-gb 2",
            server_side(path, ["--kv-cache-gb", "2"], questions, args.max_tokens),
        ),
        ("llama.cpp, n_ctx 8192", llama_side(path, questions, args.max_tokens)),
    ]
    print(f"\n{path.name}: {file_mb:.1f} MB; budget 1.5 x file + 350 MB = {budget_mb:.0f} MB")
    print(f"{args.chats} chats of at most {args.max_tokens} tokens, greedy\n")
    print(f"| {'side':28} | healthy (MB) | after the chats (MB) | within the budget |")
    print(f"|{'-' * 30}|--------------|----------------------|-------------------|")
    for name, seen in rows:
        if seen is None or seen == "failed":
            why = "not installed (pip install -e '.[bench]')" if seen is None else "crashed"
            print(f"| {name:28} | {why} | | |")
            continue
        start, end = seen[0] * 2**20 / 1e6, seen[-1] * 2**20 / 1e6  # MiB -> MB
        ok = "yes" if end < budget_mb else "no"
        print(f"| {name:28} | {start:12.0f} | {end:20.0f} | {ok:17} |")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
