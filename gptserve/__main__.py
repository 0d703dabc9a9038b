"""`python -m gptserve ...`: the same as the `gptserve` command (gptserve/cli.py)."""

import sys

from gptserve.cli import main

sys.exit(main())
