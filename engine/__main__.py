"""`python -m engine "prompt"`: offline generation through the engine (see engine/cli.py)."""

import sys

from engine.cli import main

sys.exit(main())
