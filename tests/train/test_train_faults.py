"""Training faults: a SIGKILL at any point of a checkpoint write never leaves a directory that
fails to load, and --resume continues from it.

Two kinds of kill: deterministic ones at every file rename of a checkpoint (the temp file cut in
half, or the rename done and the next file not yet written; see kill_during_write.py), and real
SIGKILLs from outside at random moments of a run that checkpoints every step. Non-finite losses
are covered by test_train.py::test_non_finite_loss_skips_steps_then_stops.
"""

from __future__ import annotations

import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from gptserve.model import load_checkpoint
from gptserve.training import cli as train
from gptserve.training.checkpointing import BEST_DIR, STATE_FILE

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
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
    "--threads",
    "1",
    "--eval-interval",
    "1",
    "--log-interval",
    "1",
    "--warmup-steps",
    "1",
]


@pytest.fixture(scope="module")
def baseline(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 2-step run that checkpointed at steps 1 and 2."""
    root = tmp_path_factory.mktemp("faults")
    data = root / "slice.txt"
    with open(shakespeare_path, encoding="utf-8") as f:
        data.write_text(f.read(20_000), encoding="utf-8")
    out = root / "base"
    argv = [
        "--data",
        str(data),
        "--out",
        str(out),
        "--cache-dir",
        str(root / "cache"),
        *TINY,
        "--max-steps",
        "2",
    ]
    assert train.main(argv) == 0
    return out


def assert_intact(out: Path, steps: set[int]) -> int:
    """The served checkpoint loads and the training state reads; returns the state's step."""
    for directory in (out, out / BEST_DIR):
        model = load_checkpoint(directory)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    state = torch.load(out / STATE_FILE, map_location="cpu", weights_only=True)
    assert state["step"] in steps
    return state["step"]


def resume_args(out: Path, max_steps: int) -> list[str]:
    return ["--out", str(out), "--resume", "--max-steps", str(max_steps)]


def run_killed(out: Path, kill_at: int, mode: str, max_steps: int) -> subprocess.CompletedProcess:
    script = str(HERE / "kill_during_write.py")
    cmd = [sys.executable, script, str(kill_at), mode, *resume_args(out, max_steps)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)


def resume(out: Path, max_steps: int) -> None:
    cmd = [sys.executable, str(REPO / "train.py"), *resume_args(out, max_steps)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert assert_intact(out, {max_steps}) == max_steps


def test_sigkill_at_every_checkpoint_rename_leaves_a_loadable_checkpoint(
    baseline: Path, tmp_path: Path
) -> None:
    # one step more (step 3) with no kill: how many renames does it do?
    dry = tmp_path / "dry"
    shutil.copytree(baseline, dry)
    r = run_killed(dry, 0, "none", 3)
    assert r.returncode == 0, r.stderr[-2000:]
    renames = int(r.stdout.rsplit("renames: ", 1)[1].split()[0])
    assert renames >= 3  # weights and config (of the last and of best/), training state
    for kill_at in range(1, renames + 1):
        for mode in ("torn", "after"):
            out = tmp_path / f"{mode}-{kill_at}"
            shutil.copytree(baseline, out)
            r = run_killed(out, kill_at, mode, 3)
            assert r.returncode == -signal.SIGKILL, (kill_at, mode, r.stderr[-2000:])
            assert_intact(out, {2, 3})
    resume(tmp_path / f"torn-{renames}", 4)  # the last file cut short: resumes from step 2
    resume(tmp_path / "after-1", 4)


def test_random_sigkills_during_a_checkpointing_run(baseline: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(baseline, out)
    rng = random.Random(0)
    steps = {2}
    for _ in range(3):
        cmd = [sys.executable, str(REPO / "train.py"), *resume_args(out, 400)]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        before = (out / STATE_FILE).stat().st_mtime_ns
        deadline = time.monotonic() + 120
        while (out / STATE_FILE).stat().st_mtime_ns == before:  # checkpoints are flowing
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the middle of later writes
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL
        step = assert_intact(out, set(range(2, 401)))
        assert step >= max(steps)
        steps.add(step)
    resume(out, max(steps) + 1)
