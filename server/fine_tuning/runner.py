"""One training subprocess: started at a lower CPU priority (nice 10) with its threads bounded
(OMP_NUM_THREADS and --threads: --fine-tune-threads), its output in OUT/train.log, its progress
read from the metrics.jsonl train.py appends (training.metrics)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from gptserve.training.metrics import METRICS_FILE

LOG_FILE = "train.log"
NICE = 10


def _lower_priority() -> None:  # runs in the child, before exec
    os.nice(NICE)


class TrainingProcess:
    def __init__(self, argv: list[str], out: Path, threads: int) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out = out
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        env.pop("PYTHONWARNINGS", None)
        with open(out / LOG_FILE, "wb") as log:
            self.proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_lower_priority, close_fds=True,
            )  # fmt: skip
        self._read = 0  # metrics rows already returned

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
        """The metrics rows logged since the last call (a line still being written waits)."""
        path = self.out / METRICS_FILE
        try:
            lines = path.read_text().splitlines()
        except OSError:
            return []
        rows = []
        for line in lines[self._read :]:
            try:
                rows.append(json.loads(line))
            except ValueError:
                break
        self._read += len(rows)
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
