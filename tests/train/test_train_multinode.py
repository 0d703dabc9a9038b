"""train.py across nodes: two torchrun "nodes" of one process each on this machine (c10d
rendezvous on 127.0.0.1, gloo on the loopback device), as docs/TRAINING.md documents them.

- an uninterrupted two-node run trains, and rank 0 alone writes;
- a worker SIGKILLed mid-run: torchrun --max-restarts restarts both nodes, --resume auto picks
  the run up from its last checkpoint, and the result is the uninterrupted run's, bit for bit;
- nodes that do not share the token cache, or --out, stop with one clear error line.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from gptserve.training.checkpointing import STATE_FILE
from gptserve.training.distributed import SHARED_STORE_WARNING, shared_store_breaks_restarts
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 60
TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--batch-size",
    "2",
    "--eval-iters",
    "1",
    "--sample-tokens",
    "0",
    "--log-interval",
    "1",
    "--warmup-steps",
    "1",
    "--lr",
    "1e-2",
    "--threads",
    "1",
    "--eval-interval",
    "10",
    "--max-steps",
    str(MAX_STEPS),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_nodes(
    node_args: list[list[str]], logs: Path, max_restarts: int = 0
) -> list[subprocess.Popen]:
    """One torchrun agent per entry of node_args (that node's train.py flags)."""
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "PYTHONFAULTHANDLER": "1",
        # a restarted round must not read the last round's gloo addresses (TRAINING.md)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    procs = []
    for n, args in enumerate(node_args):
        cmd = [
            *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
            *("--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint),
            *("--rdzv-id", run_id, "--local-addr", "127.0.0.1"),
            *("--max-restarts", str(max_restarts), str(REPO / "train.py"), *args),
        ]
        log = open(logs / f"node{n}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs: list[subprocess.Popen], timeout: float = 240) -> list[int | None]:
    """The agents' exit codes; None for one still running at the deadline (then killed)."""
    deadline = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def logs_text(logs: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("node*.log")))


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def data(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("multinode") / "slice.txt"
    with open(shakespeare_path, encoding="utf-8") as f:
        path.write_text(f.read(20_000), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted two-node run."""
    root = tmp_path_factory.mktemp("reference")
    args = ["--data", str(data), "--out", str(root / "out"), *TINY]
    codes = wait_all(start_nodes([args, args], root))
    assert codes == [0, 0], logs_text(root)[-3000:]
    return root / "out"


def test_two_nodes_train_and_rank0_writes(reference: Path) -> None:
    rows = read_metrics(reference)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))  # one writer
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 1.0
    state = torch.load(reference / STATE_FILE, weights_only=True)
    assert state["step"] == MAX_STEPS and len(state["ranks"]) == 2
    assert state["ranks"][0]["sampler"] != state["ranks"][1]["sampler"]  # own batches per rank


def worker_of(agent: subprocess.Popen) -> int | None:
    """The pid of the train.py process torchrun started, if it runs."""
    try:
        children = Path(f"/proc/{agent.pid}/task/{agent.pid}/children").read_text().split()
    except FileNotFoundError:
        return None
    for pid in children:
        try:
            if "train.py" in Path(f"/proc/{pid}/cmdline").read_text():
                return int(pid)
        except FileNotFoundError:
            continue
    return None


def test_killed_worker_is_restarted_and_the_run_resumes(
    data: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["--data", str(data), "--out", str(out), *TINY, "--resume", "auto"]
    agents = start_nodes([args, args], tmp_path, max_restarts=3)
    try:
        deadline = time.monotonic() + 180
        while not (out / STATE_FILE).exists():  # the first checkpoint (step 10)
            assert all(a.poll() is None for a in agents), logs_text(tmp_path)[-3000:]
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.02)
        victim = worker_of(agents[1])
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = torch.load(out / STATE_FILE, weights_only=True)["step"]
    finally:
        codes = wait_all(agents)
    log = logs_text(tmp_path)
    assert codes == [0, 0], log[-3000:]
    assert SHARED_STORE_WARNING not in log  # the store is not shared (start_nodes)
    assert log.count("model: ") == 2, log[-3000:]  # rank 0 started twice: once, and after the kill
    assert killed_at < MAX_STEPS
    a, b = read_metrics(reference), read_metrics(out)
    assert [r["step"] for r in b] == list(range(1, MAX_STEPS + 1))
    for ra, rb in zip(a, b):
        ra.pop("tokens_per_s"), rb.pop("tokens_per_s")
        assert ra == rb
    sa = load_file(str(reference / "model.safetensors"))
    sb = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_shared_store_under_restarts_is_warned_about() -> None:
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert shared_store_breaks_restarts(shared)
    assert not shared_store_breaks_restarts({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"})
    assert not shared_store_breaks_restarts({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"})
    assert not shared_store_breaks_restarts({})  # not under torchrun


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


def test_nodes_without_a_shared_token_cache_stop_with_one_error(data: Path, tmp_path: Path) -> None:
    base = ["--data", str(data), "--out", str(tmp_path / "out"), *TINY]
    node_args = [[*base, "--cache-dir", str(tmp_path / f"cache{n}")] for n in range(2)]
    codes = wait_all(start_nodes(node_args, tmp_path))
    log = logs_text(tmp_path)
    assert codes == [1, 1], log[-3000:]  # torchrun's code for a failed worker
    lines = error_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith("error: rank 1: the token file rank 0 wrote is not here: ")
    assert "(it is missing); every node must see --cache-dir" in lines[0]
    assert not (tmp_path / "out" / "metrics.jsonl").exists()


def test_nodes_without_a_shared_out_stop_with_one_error(
    data: Path, reference: Path, tmp_path: Path
) -> None:
    # Node 0 sees the finished reference run in its --out, node 1 an empty one.
    shutil.copytree(reference, tmp_path / "out0")
    cache = ["--cache-dir", str(reference / "cache")]
    node_args = [
        ["--data", str(data), "--out", str(tmp_path / f"out{n}"), *cache, *TINY, "--resume", "auto"]
        for n in range(2)
    ]
    node_args[0][node_args[0].index("--max-steps") + 1] = str(MAX_STEPS + 5)
    node_args[1][node_args[1].index("--max-steps") + 1] = str(MAX_STEPS + 5)
    codes = wait_all(start_nodes(node_args, tmp_path))
    log = logs_text(tmp_path)
    assert codes == [1, 1], log[-3000:]
    lines = error_lines(log)
    assert len(lines) == 1, log[-3000:]
    assert lines[0].startswith("error: the ranks see different runs in --out")
    assert f"step {MAX_STEPS}" in lines[0] and ": none" in lines[0]
    assert "every node must see --out on a shared filesystem" in lines[0]
    assert [r["step"] for r in read_metrics(tmp_path / "out0")] == list(range(1, MAX_STEPS + 1))
