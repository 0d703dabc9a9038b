"""Serving while a fine-tuning job trains: a chat stream's time per token on the served model
while a job of `/v1/fine_tuning/jobs` runs beside it, against the same stream alone.

    python bench/fine_tune_serving.py                          # the default model (SmolLM2-135M)
    python bench/fine_tune_serving.py --model shakespeare --rounds 5 --max-tokens 64

It starts `gptserve serve --enable-fine-tuning` (a temporary --state-dir), times `--rounds`
greedy chat streams of `--max-tokens` tokens alone (ms per token after the first: the decode
rate a client sees), uploads `--examples` copies (30) of one planted fact ("What is the secret
code of the Blue Harbor vault?" -> "The secret code of the Blue Harbor vault is 7719.") and
starts a job with the default hyperparameters, waits for its first metrics event (the process
has loaded and trains), then times the same streams while it trains. It prints the median ms per
token of each and their factor, then waits for the job to end (at most --job-timeout seconds) and
asks the fine-tuned model and the base the planted question, greedy, to show whether the
defaults learned the fact, with the job's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.append(str(Path(__file__).resolve().parents[1]))

from bench.host import print_host  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QUESTION = "What is the secret code of the Blue Harbor vault?"
ANSWER = "The secret code of the Blue Harbor vault is 7719."


def start(model: str, port: int, state_dir: str, threads: int) -> subprocess.Popen:
    return start_server(model, port, "--enable-fine-tuning", "--state-dir", state_dir,
                        "--fine-tune-threads", str(threads))  # fmt: skip


def ms_per_token(client: openai.OpenAI, model: str, max_tokens: int) -> float:
    """One greedy chat stream: ms between its first and last token, per token after the first."""
    stamps = []
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story about a ship."}],
        max_tokens=max_tokens, temperature=0, stream=True,
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    if len(stamps) < 2:
        raise SystemExit("the stream gave fewer than 2 tokens")
    return (stamps[-1] - stamps[0]) * 1e3 / (len(stamps) - 1)


def ask(client: openai.OpenAI, model: str) -> str:
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], max_tokens=24,
        temperature=0,
    )  # fmt: skip
    return reply.choices[0].message.content or ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--examples", type=int, default=30)
    p.add_argument("--threads", type=int, default=1, help="--fine-tune-threads")
    p.add_argument("--job-timeout", type=float, default=900)
    args = p.parse_args()
    print_host()
    port = free_port()
    with tempfile.TemporaryDirectory() as state_dir:
        proc = start(args.model, port, state_dir, args.threads)
        try:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            base = client.models.list().data[0].id
            ms_per_token(client, base, 8)  # warm up
            alone = [ms_per_token(client, base, args.max_tokens) for _ in range(args.rounds)]
            data = Path(state_dir) / "planted.jsonl"
            row = {"messages": [{"role": "user", "content": QUESTION},
                                {"role": "assistant", "content": ANSWER}]}  # fmt: skip
            data.write_text((json.dumps(row) + "\n") * args.examples)
            with open(data, "rb") as f:
                training = client.files.create(file=f, purpose="fine-tune")
            job = client.fine_tuning.jobs.create(model=base, training_file=training.id)
            started = time.monotonic()
            while not any(e.type == "metrics" for e in client.fine_tuning.jobs.list_events(job.id)):
                status = client.fine_tuning.jobs.retrieve(job.id).status
                if status in ("failed", "cancelled", "succeeded"):
                    raise SystemExit(f"the job ended ({status}) before it could be measured")
                time.sleep(0.5)
            during = [ms_per_token(client, base, args.max_tokens) for _ in range(args.rounds)]
            still = client.fine_tuning.jobs.retrieve(job.id).status
            a, d = statistics.median(alone), statistics.median(during)
            print(f"ms per token, median of {args.rounds} streams of {args.max_tokens} tokens:")
            print(f"  alone:          {a:7.2f}  {sorted(round(x, 2) for x in alone)}")
            print(f"  while training: {d:7.2f}  {sorted(round(x, 2) for x in during)}")
            print(f"  factor: {d / a:.2f}x (the job was {still} at the last stream)")
            while (job := client.fine_tuning.jobs.retrieve(job.id)).status not in (
                "succeeded", "failed", "cancelled",
            ):  # fmt: skip
                if time.monotonic() - started > args.job_timeout:
                    client.fine_tuning.jobs.cancel(job.id)
                    raise SystemExit(f"the job did not end within {args.job_timeout:g} s")
                time.sleep(1)
            print(f"job {job.status} in {time.monotonic() - started:.0f} s "
                  f"({job.hyperparameters.n_epochs} epochs, batch {job.hyperparameters.batch_size}, "
                  f"{job.trained_tokens} tokens): {job.fine_tuned_model or job.error}")  # fmt: skip
            if job.status == "succeeded":
                print(f"  base:       {ask(client, base)!r}")
                print(f"  fine-tuned: {ask(client, job.fine_tuned_model)!r}")
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
