"""Keep freed CPU memory in the process so large temporaries are not page-faulted in every step.

PyTorch's CPU allocator hands each tensor to malloc. glibc serves blocks above its mmap threshold
(128 KiB to 32 MiB, adaptive) with fresh `mmap`s and returns them on free, so large temporaries
are zero-filled page by page again at every use. A training step's logits alone are 411 MB
(GPT-2 vocabulary, 2048 tokens); `python bench/train.py` shows the transformers baseline with and
without this setting; for a 32-sequence decode step it is worth 1.07-1.4x
(`python bench/cpu_parts.py`). Raising the mmap and trim thresholds keeps those pages in the heap
for reuse. The cost is that the
process's resident size stays at its high-water mark instead of shrinking after a peak.

In a thread other than the main one glibc serves blocks from per-thread heaps of at most 64 MiB,
so there the setting covers blocks below that size (a decode step's temporaries are).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1  # glibc mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_THRESHOLDS = (1 << 30, 32 << 20)  # blocks up to 1 GiB stay in the heap; older glibc caps at 32 MiB

_done = False


def retain_freed_memory() -> bool:
    """Tune glibc malloc once per process; False where the C library is not glibc."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    for threshold in _THRESHOLDS:
        if mallopt(_M_MMAP_THRESHOLD, threshold) == 1:
            _done = mallopt(_M_TRIM_THRESHOLD, threshold) == 1
            return _done
    return False


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the system once (glibc's malloc_trim), as after a load,
    whose temporaries `retain_freed_memory` would otherwise keep; False where not glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False
