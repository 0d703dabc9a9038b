"""The Triton kernels: fused causal attention for training (`flash`), paged attention over the KV
cache (`paged`) and the online softmax both fold tiles with (`softmax`).

They compile for CUDA; on a CPU they run only under the Triton interpreter (TRITON_INTERPRET=1,
set before triton is imported), which is how the tests run them. Importing this package does not
import triton: its modules do, and `available()` says whether they can.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def available() -> bool:
    """Whether triton is installed (looked up once, without importing it)."""
    return importlib.util.find_spec("triton") is not None
