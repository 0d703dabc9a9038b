"""The process's resident memory, for the load and unload log lines and the benchmark."""

from __future__ import annotations

import os


def rss_bytes() -> int | None:
    """Resident set size of this process in bytes (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")
