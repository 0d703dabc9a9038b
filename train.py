#!/usr/bin/env python
"""`python train.py ...` from a checkout: the same as `gptserve train ...` (gptserve/training/cli.py).

A script's own folder heads `sys.path`. Here that is the checkout's root, whose `kernels/` would
stand in for Hugging Face's `kernels` package, which transformers imports: the root is dropped
before anything is imported, and gptserve comes from its install (`pip install -e .`).
"""

import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]

from gptserve.training.cli import leave, main  # noqa: E402

if __name__ == "__main__":
    leave(main())
