#!/usr/bin/env python
"""`python train.py ...`: train a GPT on text into a directory the server serves as is.

The command line over the `training` package: flags become a TrainConfig (training/args.py, whose
text `--help` prints) and training/loop.py runs it; docs/TRAINING.md describes what is written.
"""

from __future__ import annotations

import sys

import torch.distributed as dist

from training.args import parse_config
from training.distributed import Dist, join_process_group, on_every_rank
from training.errors import TrainError
from training.loop import train


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
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
