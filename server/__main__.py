"""`python -m gptserve.server`: the same as `gptserve serve` (see server/cli.py)."""

import sys

from gptserve.server.cli import main

sys.exit(main())
