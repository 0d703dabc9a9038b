#!/usr/bin/env python
"""`python train.py ...`: train a GPT on text into a directory the server serves as is.

The command line over the `training` package; `python train.py --help` (text in training/args.py)
and docs/TRAINING.md describe the flags and what is written.
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from training.args import resolve_args
from training.errors import TrainError
from training.loop import train


def main(argv: list[str] | None = None) -> int:
    try:
        args = resolve_args(argv)
        train(args)
    except TrainError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted; continue with --resume", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
