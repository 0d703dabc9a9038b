"""`python -m server.ray`: start a local Ray and serve replicas (see server/ray/cli.py)."""

import sys

from server.ray.cli import main

sys.exit(main())
