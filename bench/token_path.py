"""The server's per-token cost: one greedy stream through the engine alone and over HTTP, same run.

    python bench/token_path.py [--model NAME|PATH] [--max-tokens 64] [--rounds 5] [--threads N]
    python bench/token_path.py --against HEAD      # a server of that revision measured beside it
    python bench/token_path.py --against DIR       # or of another checkout's files as they are

One process loads the model and runs its AsyncEngine as `gptserve serve` does (server.runtime);
`gptserve serve` runs the same model (its defaults) in a second process, and with --against a
third one runs the given git revision from a temporary worktree. Each round measures, in turn:

- engine: `Engine.step` in a loop on the engine thread (`AsyncEngine.run_on_engine`), no events
  handed anywhere;
- AsyncEngine: `AsyncEngine.generate` read by an asyncio task (the engine thread hands each event
  to the event loop);
- /v1/completions and /v1/chat/completions with stream=true, read by a plain HTTP client.

The request is the same everywhere: one fixed prompt, `--max-tokens` new tokens, greedy, the end
of text ignored. ms/token is what a client sees: the time between the first and the last token
(a streamed chunk that carries text) over their count less one. CPU ms/token is the CPU time the
measured side's process spent in that span (every thread: /proc's schedstat), over the same
count: a steadier figure than the wall clock on a shared machine; loop CPU is its main thread's
share, the event loop's (uvicorn's in a server, asyncio's here; idle in the engine row). The
table gives each row's median over the rounds (and the best ms/token) and its overhead over the
engine row, and says whether every round's text equals the engine's (the chat rows, whose
prompt is the template's, the first chat row's). The overhead over `engine` is the server's
per-token path: handing events to the event loop, the merge of a request's streams, the chunk's
JSON, the SSE framing and the socket.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))

from gptserve.engine.engine import Engine  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model.known_models import resolve_model  # noqa: E402
from gptserve.server.metrics import Metrics  # noqa: E402
from gptserve.server.runtime import ServerState  # noqa: E402
from gptserve.server.settings import settings_from_args  # noqa: E402

from bench.host import print_host  # noqa: E402
from bench.serve import free_port, start_server  # noqa: E402

T = TypeVar("T")
SERVER_FLAGS = ("--max-num-seqs", "32")  # what bench.serve.start_server passes
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Sample:
    """One measured stream: when each token (chunk with text) arrived, the process's CPU
    seconds at the first and the last, and the text."""

    times: list[float] = field(default_factory=list)
    # (every thread's, the main thread's) CPU seconds at the first and at the last token
    cpu: list[tuple[float, float]] = field(default_factory=list)
    text: list[str] = field(default_factory=list)

    def add(
        self, now: float, text: str, last: bool, cpu_now: Callable[[], tuple[float, float]]
    ) -> None:
        """A token that came at `now`; `last`: the stream's last (its CPU is read then, and at
        the first: reading it at every token would cost the reader more than the path)."""
        self.times.append(now)
        self.text.append(text)
        if len(self.times) == 1 or last:
            self.cpu.append(cpu_now())

    @property
    def ms_per_token(self) -> float:
        return (self.times[-1] - self.times[0]) / (len(self.times) - 1) * 1e3

    @property
    def cpu_ms_per_token(self) -> float:
        return (self.cpu[-1][0] - self.cpu[0][0]) / (len(self.times) - 1) * 1e3

    @property
    def loop_ms_per_token(self) -> float:
        """The main thread's CPU: the event loop's, where there is one (uvicorn's, asyncio's)."""
        return (self.cpu[-1][1] - self.cpu[0][1]) / (len(self.times) - 1) * 1e3


def own_cpu() -> tuple[float, float]:
    """This process's CPU seconds so far, and its main thread's (called on the main thread)."""
    return time.process_time(), time.thread_time()


def process_cpu(pid: int, main_thread: int | None = None) -> tuple[float, float]:
    """CPU seconds so far of every thread of a process and of its main thread (by default the
    thread whose id is the process's; schedstat: nanoseconds, not ticks)."""
    total = main = 0
    main_name = str(pid if main_thread is None else main_thread)
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that ended meanwhile
            continue
        total += ns
        if task.name == main_name:
            main = ns
    return total / 1e9, main / 1e9


# ---- in-process sides ----------------------------------------------------------------------


def run_loop(coro: Coroutine[None, None, T]) -> T:
    """`coro` run on the event loop uvicorn would use: uvloop's where it is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


class InProcess:
    """The model in this process as `gptserve serve` runs it (`server.runtime.ServerState`:
    loaded in a thread that ends, the Engine built on the engine thread with the server's
    configuration, the metrics counting its steps), without the HTTP server."""

    def __init__(self, path: Path) -> None:
        settings = settings_from_args(["--model", str(path), *SERVER_FLAGS])
        state = ServerState(settings, Metrics())
        state.start_loading().join()
        if state.load_error is not None:
            raise SystemExit(f"the model did not load: {state.load_error}")
        self.tokenizer = state.loaded.tokenizer
        self.async_engine = state.async_engine
        self.ids = self.tokenizer.encode(PROMPT)
        self.runs = 0

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)

    def engine_alone(self, max_tokens: int) -> Sample:
        """Engine.step until the request ends, on the engine thread."""
        self.runs += 1
        rid, params = f"engine-{self.runs}", self.params(max_tokens)

        def work(engine: Engine) -> Sample:
            sample = Sample()
            main = threading.main_thread().native_id

            def cpu() -> tuple[float, float]:  # on the engine thread: the main one's from /proc
                return time.process_time(), process_cpu(os.getpid(), main)[1]

            engine.add_request(rid, self.ids, params)
            while engine.has_work():
                for event in engine.step():
                    if event.token_ids:
                        sample.add(time.perf_counter(), event.text, event.finished, cpu)
            return sample

        return run_loop(self._on_engine(work))

    async def _on_engine(self, work: Callable[[Engine], Sample]) -> Sample:
        return await self.async_engine.run_on_engine(work, timeout=600)

    def async_engine_stream(self, max_tokens: int) -> Sample:
        """AsyncEngine.generate read by a task of an event loop."""
        self.runs += 1

        async def read() -> Sample:
            sample = Sample()
            rid = f"async-{self.runs}"
            async for event in self.async_engine.generate(rid, self.ids, self.params(max_tokens)):
                if event.token_ids:
                    sample.add(time.perf_counter(), event.text, event.finished, own_cpu)
            return sample

        return run_loop(read())


# ---- HTTP sides ----------------------------------------------------------------------------


def http_stream(port: int, pid: int, endpoint: str, max_tokens: int) -> Sample:
    """One streamed request, read line by line with a plain client (little CPU of its own)."""
    body: dict = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    if endpoint == "completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    sample = Sample()
    try:
        conn.request("POST", f"/v1/{endpoint}", json.dumps(body),
                     {"Content-Type": "application/json"})  # fmt: skip
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"/v1/{endpoint}: HTTP {response.status}: {response.read()[:300]!r}")
        while line := response.readline():
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"/v1/{endpoint}: {chunk['error']}")
            choice = chunk["choices"][0]
            text = choice.get("text") if "text" in choice else choice["delta"].get("content")
            finished = choice.get("finish_reason") is not None
            if text:
                sample.add(now, text, finished, lambda: process_cpu(pid))
            elif finished and sample.times:  # the end came without text: its CPU all the same
                sample.cpu.append(process_cpu(pid))
    finally:
        conn.close()
    return sample


def other_tree(against: str, tmp: str) -> tuple[Path, str]:
    """The tree --against names and its label: a directory holding a checkout as it is, or a git
    revision checked out in a temporary worktree."""
    if Path(against).is_dir():
        return Path(against).resolve(), Path(against).name
    rev = subprocess.run(["git", "rev-parse", "--short", against], cwd=REPO, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    if not rev:
        raise SystemExit(f"no git revision or directory {against!r}")
    tree = Path(tmp) / "before"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=REPO, check=True,
                   capture_output=True)  # fmt: skip
    return tree, rev


def tree_server(tree: Path, model: Path, port: int) -> subprocess.Popen:
    """`gptserve serve` of another tree's sources, with the flags `start_server` gives."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-m", "gptserve.server", "--model", str(model), "--port", str(port),
           *SERVER_FLAGS, "--log-level", "warning"]  # as bench.serve.start_server  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tree, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the {tree} server exited with {proc.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc
        except OSError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise SystemExit(f"the {tree} server did not become ready")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="as `gptserve serve --model`")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads of every side (OMP_NUM_THREADS; default: torch's)")  # fmt: skip
    p.add_argument("--against", default=None,
                   help="a git revision, or a directory holding another checkout, served beside "
                        "this tree")  # fmt: skip
    args = p.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers inherit it
        torch.set_num_threads(args.threads)
    print_host()
    path = resolve_model(args.model)
    side = InProcess(path)
    servers: list[tuple[str, int, subprocess.Popen]] = []
    tmp = tempfile.TemporaryDirectory() if args.against else None
    try:
        port = free_port()
        servers.append(("", port, start_server(path, port)))
        if args.against:
            tree, label = other_tree(args.against, tmp.name)
            port = free_port()
            servers.append((f" ({label})", port, tree_server(tree, path, port)))
        rows: dict[str, Callable[[], Sample]] = {
            "engine (Engine.step)": lambda: side.engine_alone(args.max_tokens),
            "AsyncEngine.generate": lambda: side.async_engine_stream(args.max_tokens),
        }
        for label, port, proc in servers:
            for endpoint in ("completions", "chat/completions"):
                rows[f"HTTP /v1/{endpoint}{label}"] = (
                    lambda port=port, proc=proc, endpoint=endpoint: http_stream(
                        port, proc.pid, endpoint, args.max_tokens
                    )
                )
        for measure in rows.values():  # warm-up: kernels built, pages touched, caches filled
            measure()
        results: dict[str, list[Sample]] = {name: [] for name in rows}
        for r in range(args.rounds):
            names = list(rows) if r % 2 == 0 else list(rows)[::-1]  # a slow spell hits all sides
            for name in names:
                results[name].append(rows[name]())
            print(f"round {r + 1} of {args.rounds} done", flush=True)
    finally:
        for _, _, proc in servers:
            proc.terminate()
            proc.wait(60)
        side.async_engine.stop()
        if tmp is not None:
            subprocess.run(["git", "worktree", "remove", "--force", str(Path(tmp.name) / "before")],
                           cwd=REPO, capture_output=True)  # fmt: skip
            tmp.cleanup()

    base = results["engine (Engine.step)"]
    base_ms = statistics.median(s.ms_per_token for s in base)
    base_cpu = statistics.median(s.cpu_ms_per_token for s in base)
    base_text = "".join(base[0].text)
    chat_text = "".join(next(v for k, v in results.items() if "chat" in k)[0].text)
    print(f"\n{path.name}: {args.max_tokens} new tokens, greedy, prompt {len(side.ids)} tokens "
          f"(completions), torch threads {torch.get_num_threads()}; median of {args.rounds} "
          f"rounds")  # fmt: skip
    print(f"| {'path':36} | ms/token | best | overhead | CPU ms/token | CPU overhead | "
          f"loop CPU | tokens | text |")  # fmt: skip
    print(f"|{'-' * 38}|---------:|-----:|---------:|-------------:|-------------:|---------:|"
          f"-------:|------|")  # fmt: skip
    for name, samples in results.items():
        ms = statistics.median(s.ms_per_token for s in samples)
        best = min(s.ms_per_token for s in samples)
        cpu = statistics.median(s.cpu_ms_per_token for s in samples)
        loop = statistics.median(s.loop_ms_per_token for s in samples)
        texts = {"".join(s.text) for s in samples}
        ref = chat_text if "chat" in name else base_text  # the first chat row's, the engine's
        same = "same" if texts == {ref} else "DIFFERS"
        print(f"| {name:36} | {ms:8.2f} | {best:4.2f} | {ms - base_ms:+8.2f} | {cpu:12.2f} | "
              f"{cpu - base_cpu:+12.2f} | {loop:8.3f} | {len(samples[0].times):6} | {same:4} |")  # fmt: skip


if __name__ == "__main__":
    main()
