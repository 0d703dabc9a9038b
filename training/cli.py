"""`gptserve train ...` (or `python train.py ...` from a checkout): train a GPT on text into a directory the server serves as is.

The command line over the `training` package: flags become a TrainConfig (training/args.py, whose
text `--help` prints) and training/loop.py runs it; docs/TRAINING.md describes what is written.
"""

from __future__ import annotations

import os
import sys

from gptserve.training.args import parse_config
from gptserve.training.distributed import Dist, join_process_group, on_every_rank
from gptserve.training.errors import TrainError
from gptserve.training.loop import train


def main(argv: list[str] | None = None) -> int:
    info = Dist()
    try:
        info = join_process_group()  # under torchrun; first, so that every error reaches rank 0
        cfg = on_every_rank(lambda: parse_config(argv))
        train(cfg, info)
    except TrainError as exc:
        if info.master:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted; continue with --resume", file=sys.stderr)
        return 130
    return 0


def leave(code: int) -> None:
    """Exit with `code`. Under torchrun the worker leaves without destroying its process group
    and without Python's and C++'s teardown: every rank is done by then (`train` ends on a
    barrier, and a TrainError reaches every rank), and in that teardown gloo's and the store's
    threads could abort a finished worker ("terminate called without an active exception") or
    hang it on a peer that has already gone, failing a run that succeeded."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    leave(main())
