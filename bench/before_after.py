"""An engine's speed before and after a change, in one run: this tree against a git revision.

    python bench/before_after.py --against REV [--rounds 3] [--model NAME|PATH]

Checks REV out into a temporary worktree and, each round, runs the same measurement in a fresh
process of each tree (the order alternating, so a noisy spell hits both sides), on the same
model (default: the default model, SmolLM2-135M-Instruct's GGUF file as `gptserve serve`
serves it): one greedy stream (64-token prompt, 64 new tokens), 16 streams, and a 512-token
prompt's prefill. Prints the host, then a table of the best round of each side and their ratio.
The measurement goes through `engine.loader.load_for_inference`, `Engine.add_request` and
`Engine.step`, which both trees have.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.host import print_host  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import importlib, json, os, sys, time
import torch

# the tree measured, whatever its layout: gptserve.* (gptserve/__init__.py finds the root's
# folders), or an older tree's top-level packages
tree = sys.argv[2]
sys.path.insert(0, tree)  # before any install of gptserve
prefix = "gptserve." if os.path.isdir(os.path.join(tree, "gptserve")) else ""
def part(name):
    return importlib.import_module(prefix + name)
Engine, EngineConfig = part("engine.engine").Engine, part("engine.engine").EngineConfig
load_for_inference = part("engine.loader").load_for_inference
SamplingParams = part("engine.sampler").SamplingParams
print("measuring", part("engine.engine").__file__, file=sys.stderr)

path = part("model.known_models").resolve_model(sys.argv[1])
loaded = load_for_inference(path, device="cpu", dtype="auto", quantization="none")
engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(prefix_caching=False))
vocab = loaded.model.config.vocab_size
gen = torch.Generator().manual_seed(0)

def prompt(n):
    return torch.randint(100, vocab - 1, (n,), generator=gen).tolist()

def run(prompts, new):
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{run.calls}-{i}", ids, SamplingParams(
            temperature=0, max_tokens=new, ignore_eos=True))
    run.calls += 1
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - start
run.calls = 0

run([prompt(16)], 8)  # warm-up: kernels built, pages touched
rates = {}
secs = run([prompt(64)], 64); rates["decode x1 (tok/s)"] = 64 / secs
secs = run([prompt(64) for _ in range(16)], 64); rates["decode x16 (tok/s)"] = 16 * 64 / secs
secs = run([prompt(512)], 1); rates["prefill 512 (tok/s)"] = 512 / secs
print(json.dumps(rates))
"""


def measure(tree: Path, model: str) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model, str(tree)], cwd=tree, capture_output=True, text=True,
        env={**os.environ, "PYTHONPATH": str(tree)}, timeout=1800,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"the measurement failed in {tree}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", required=True, help="the git revision measured as 'before'")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="smollm2-135m-instruct")
    args = p.parse_args()
    print_host()
    rev = subprocess.run(
        ["git", "rev-parse", "--short", args.against], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    if not rev:
        raise SystemExit(f"no git revision {args.against!r}")
    with tempfile.TemporaryDirectory() as tmp:
        before = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), rev], cwd=REPO,
                       check=True, capture_output=True)  # fmt: skip
        try:
            best: dict[str, dict[str, float]] = {"before": {}, "after": {}}
            for r in range(args.rounds):
                sides = [("before", before), ("after", REPO)]
                for side, tree in sides if r % 2 == 0 else sides[::-1]:
                    for row, rate in measure(tree, args.model).items():
                        best[side][row] = max(best[side].get(row, 0.0), rate)
                print(f"round {r + 1} of {args.rounds} done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO,
                           capture_output=True)  # fmt: skip
    print(f"\n{args.model}: before = {rev}, after = this tree; best of {args.rounds} rounds\n")
    print(f"| {'row':22} | {'before':>9} | {'after':>9} | after / before |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 11}|----------------|")
    for row in best["after"]:
        b, a = best["before"][row], best["after"][row]
        print(f"| {row:22} | {b:9.1f} | {a:9.1f} | {a / b:14.2f} |")


if __name__ == "__main__":
    main()
