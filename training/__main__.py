"""`python -m gptserve.training`: the same as `gptserve train` (see training/cli.py)."""

from gptserve.training.cli import leave, main

leave(main())
