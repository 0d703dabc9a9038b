"""One training subprocess: started at a lower CPU priority (nice 10) with its threads bounded
(OMP_NUM_THREADS and --threads: --fine-tune-threads), its output in OUT/train.log, its progress
read from the metrics.jsonl train.py appends (training.metrics).

The process does not outlive the server: on Linux the kernel kills it (SIGKILL, the parent-death
signal) when the thread that started it ends, the server killed included, so no orphan goes on
writing into --state-dir. Start it from a thread that lives as long as the server (the event
loop's). Its checkpoints are written atomically, so that kill never leaves one half written.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gptserve.training.metrics import METRICS_FILE

LOG_FILE = "train.log"
NICE = 10
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _pdeathsig() -> Callable[[int, int], int] | None:
    """libc's prctl on Linux (looked up before the fork: the child only calls it), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes, prctl.restype = [ctypes.c_int, ctypes.c_ulong], ctypes.c_int
    return prctl


def _child_setup(parent: int) -> Callable[[], None]:
    prctl = _pdeathsig()

    def setup() -> None:  # runs in the child, before exec
        os.nice(NICE)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the server died before the signal was asked for
            os._exit(1)

    return setup


class TrainingProcess:
    def __init__(self, argv: list[str], out: Path, threads: int, after_step: int = 0) -> None:
        """Start `argv`; `new_metrics` returns only the rows past step `after_step` (a resumed run
        rewrites the rows after its checkpoint, which were reported already)."""
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.pop("PYTHONWARNINGS", None)
        with open(out / LOG_FILE, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_child_setup(os.getpid()), close_fds=True,
            )  # fmt: skip
        self._step = after_step  # the last step returned

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the run (killed if it has not ended within `timeout` seconds)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def new_metrics(self) -> list[dict[str, Any]]:
        """The metrics rows of steps past the last returned (a line still being written waits;
        a resumed run trims the file to its checkpoint, so rows are told apart by step)."""
        path = self.out / METRICS_FILE
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return []
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                break
            if (
                isinstance(row, dict)
                and isinstance(row.get("step"), int)
                and row["step"] > self._step
            ):
                rows.append(row)
                self._step = row["step"]
        return rows

    def failure(self) -> str:
        """Why the run failed: its last `error:` line, else the end of its log."""
        try:
            text = (self.out / LOG_FILE).read_text(errors="replace")
        except OSError:
            return "the training process failed"
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        if errors:
            return errors[-1][len("error:") :].strip()
        tail = text.strip().splitlines()[-1:] or [f"exit status {self.proc.returncode}"]
        return f"the training process failed: {tail[0][-500:]}"
