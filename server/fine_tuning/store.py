"""Records kept as one JSON file each under a directory, reloaded at start.

`RecordStore(dir)` holds `id -> dict` in memory (insertion order: creation order) and writes a
record atomically (a temporary file renamed) whenever it is saved, so a restart finds every
record as last saved. Fields whose names begin with `_` are the server's own (`public` drops them):
`_owner` (a tenant id, or None on an open server) says who sees the record.
"""

from __future__ import annotations

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
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self.records: dict[str, dict[str, Any]] = {}
        found = []
        for path in directory.glob("*.json"):
            try:
                found.append(json.loads(path.read_text()))
            except (OSError, ValueError) as exc:
                log.warning("skipping the unreadable record %s: %s", path, exc)
        for record in sorted(found, key=lambda r: (r.get("created_at", 0), r.get("_seq", 0))):
            self.records[record["id"]] = record

    def save(self, record: dict[str, Any]) -> None:
        with self._lock:
            self.records[record["id"]] = record
            path = self.directory / f"{record['id']}.json"
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)

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


def page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI's cursor list: the items after the one with id `after`, at most `limit`."""
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return {"object": "list", "data": items[:limit], "has_more": len(items) > limit}


def public(record: dict[str, Any]) -> dict[str, Any]:
    """The record as the API answers it: without the server's own `_` fields."""
    return {k: v for k, v in record.items() if not k.startswith("_")}
