#!/usr/bin/env python
"""Train a GPT on UTF-8 text; the output directory is directly servable (`python -m server --model DIR`).

    python train.py --data shakespeare.txt --out runs/shakespeare --max-steps 2000
    python train.py --out runs/shakespeare --resume            # continue a killed run
    torchrun --nproc_per_node 2 train.py --data ... --out ...  # DistributedDataParallel

Writes into DIR: config.json + model.safetensors (last), best/ (lowest validation loss),
train_state.pt (everything --resume needs, full fp32 weights included), metrics.jsonl, loss.png
and cache/ (the tokenized data). See docs/TRAINING.md.
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
