"""`python -m gptserve.engine "prompt"`: the same as `gptserve generate` (see engine/cli.py)."""

import sys

from gptserve.engine.cli import main

sys.exit(main())
