"""`python -m gptserve.server.ray`: the same as `gptserve ray` (see server/ray/cli.py)."""

import sys

from gptserve.server.ray.cli import main

sys.exit(main())
