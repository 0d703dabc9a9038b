"""Records kept as one JSON file each under a directory, reloaded at start.

`RecordStore(dir)` holds `id -> dict` in memory (insertion order: creation order) and writes a
record atomically (`write_atomic`: a temporary file renamed over it) whenever it is saved, so a
server killed at any instant (SIGKILL, a full disk) leaves each record as it was last saved, never
half written. A save that cannot write raises OSError with the memory copy already updated.
Fields whose names begin with `_` are the server's own (`public` drops them): `_owner` (a tenant
id, or None on an open server) says who sees the record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class RecordStore:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        make_directory(directory)
        self._lock = threading.Lock()
        self.records: dict[str, dict[str, Any]] = {}
        found = []
        try:
            paths = sorted(directory.glob("*.json"))
        except OSError:  # logged by make_directory
            paths = []
        for path in paths:
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("skipping the unreadable record %s: %s", path, exc)
        for record in sorted(found, key=lambda r: (r.get("created_at", 0), r.get("_seq", 0))):
            self.records[record["id"]] = record

    def save(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records[record["id"]] = record
            write_atomic(self.directory / f"{record['id']}.json", json.dumps(record).encode())

    def delete(self, record_id: str) -> None:
        with self._lock:
            self.records.pop(record_id, None)
            (self.directory / f"{record_id}.json").unlink(missing_ok=True)

    def get(self, record_id: str, owner: str | None, any_owner: bool = False) -> dict | None:
        """The record when `owner` may see it (or `any_owner`), else None."""
        record = self.records.get(record_id)
        if record is None or not (any_owner or record.get("_owner") == owner):
            return None
        return record

    def owned(self, owner: str | None) -> list[dict[str, Any]]:
        return [r for r in list(self.records.values()) if r.get("_owner") == owner]


def make_directory(directory: Path) -> None:
    """mkdir -p, or an error logged: a state directory that cannot be made fails the writes
    into it (each answered on its own), not the server's start."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error(
            "cannot create %s (%s): files and fine-tuning jobs cannot be kept", directory, exc
        )


def write_atomic(path: Path, data: bytes) -> None:
    """`data` into `path` through a temporary file beside it, flushed to disk, then renamed over
    it: a reader (or a restart) sees the old content or the new, never a part. On OSError (a full
    or read-only disk) `path` is untouched and the temporary file removed."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor list: the items after the one with id `after`, at most `limit`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return {"object": "list", "data": items[:limit], "has_more": len(items) > limit}


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The record as the API answers it: without the server's own `_` fields."""
    return {k: v for k, v in record.items() if not k.startswith("_")}
