"""Run train.main(argv) in this process, dying by SIGKILL at the K-th checkpoint-file rename.

    python kill_during_write.py K MODE TRAIN_ARGS...

Every checkpoint file is written to a temp file and renamed over its target (os.replace). With
MODE "torn" the K-th rename instead cuts its temp file to half its size and the process kills
itself (a write interrupted half-way); with MODE "after" the rename happens and then the process
dies (a kill between two files of one checkpoint). K = 0 never kills and prints the number of
renames on exit. Only renames onto checkpoint files count (not metrics.jsonl or loss.png).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))

from gptserve.training import cli as train  # noqa: E402
from gptserve.training.checkpointing import STATE_FILE  # noqa: E402

CHECKPOINT_FILES = {"model.safetensors", "config.json", STATE_FILE}


def main() -> int:
    kill_at, mode, argv = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    real_replace = os.replace
    calls = 0

    def replace(src, dst, *args, **kwargs):  # noqa: ANN001, ANN202
        nonlocal calls
        if Path(dst).name not in CHECKPOINT_FILES:
            return real_replace(src, dst, *args, **kwargs)
        calls += 1
        if calls == kill_at and mode == "torn":
            with open(src, "r+b") as f:
                f.truncate(os.path.getsize(src) // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        real_replace(src, dst, *args, **kwargs)
        if calls == kill_at and mode == "after":
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace
    code = train.main(argv)
    print(f"renames: {calls}")
    return code


if __name__ == "__main__":
    sys.exit(main())
