# The checkout's root must not head sys.path: its kernels/ folder would stand in for Hugging
# Face's `kernels` package, which transformers imports (gptserve itself imports as gptserve.*, from
# its install). `python -m pytest` puts the working directory first and pyproject.toml's
# --import-mode=importlib keeps pytest from inserting it again: move the root behind everything
# installed, where the tests' own helpers (`tests.*`, `bench.*`) still resolve.
import os
import sys

_ROOT = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT] + [_ROOT]

# Triton decides between compiling and interpreting when a kernel is defined, so the interpreter
# switch must be set before anything imports triton. On a machine with CUDA, GPTSERVE_TRITON_CUDA=1
# keeps the real compiler (bench/gpu_check.sh sets it).
if os.environ.get("GPTSERVE_TRITON_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
