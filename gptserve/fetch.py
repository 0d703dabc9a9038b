"""`gptserve fetch`: what a start would fetch or build, done ahead of it.

    gptserve fetch                                   # the default model, into the cache
    gptserve fetch --model shakespeare --kernels x86-64-v3,x86-64-v4

Fetches each known model into the cache (`$GPTSERVE_CACHE`) and builds the CPU kernels for each
named `-march` target into PyTorch's extension cache (`TORCH_EXTENSIONS_DIR`), so that a later
`gptserve serve` neither downloads nor compiles: the Docker image runs this at build time
(deploy/docker/install.sh). `--kernels native` builds for this host's own instruction sets.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from gptserve.model.known_models import DEFAULT_MODEL_NAME, FetchError, fetch_known_model

# a child process a target: each build loads its library, and a process can hold only one
BUILD_CHILD = (
    "import logging, sys; logging.basicConfig(level='INFO', format='%(message)s');"
    "from gptserve.kernels.cpu.native import native_ops; sys.exit(native_ops() is None)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gptserve fetch", description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", action="append", default=None,
        help=f"a known model's name, repeatable (default: {DEFAULT_MODEL_NAME})",
    )  # fmt: skip
    p.add_argument(
        "--kernels", default="",
        help="comma-separated -march targets to build the CPU kernels for, e.g. "
        "x86-64-v3,x86-64-v4 (default: none)",
    )  # fmt: skip
    return p.parse_args(argv)


def build_kernels(arch: str) -> bool:
    """Build (or find built) the CPU kernels for `-march=arch`, in a child process; True if done."""
    env = {**os.environ, "GPTSERVE_NATIVE": "1", "GPTSERVE_NATIVE_ARCH": arch}
    return subprocess.run([sys.executable, "-c", BUILD_CHILD], env=env).returncode == 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in args.model or [DEFAULT_MODEL_NAME]:
        try:
            path = fetch_known_model(name, progress=lambda line: print(line, flush=True))
        except FetchError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"{name}: {path}", flush=True)
    for arch in filter(None, (a.strip() for a in args.kernels.split(","))):
        if not build_kernels(arch):
            print(f"error: the CPU kernels could not be built for -march={arch}", file=sys.stderr)
            return 1
    return 0
