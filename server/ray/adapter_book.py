"""The record of LoRA adapters loaded at run time, shared by every replica of a deployment.

An admin's `POST /v1/load_lora_adapter` (or unload) reaches one replica; that replica records
the change here (`record`), and every replica applies it to the base model when it holds that
base, or when it loads it later (gptserve.server.ray.adapter_sync). Replicas learn of changes
by long polling `sync`, which also carries what each has applied; `wait_applied` lets the
replica that took the admin's request answer only once every live replica has applied it.

It runs as a deployment of one replica (`AdapterBook`, deployed beside the engines when the
server loads adapters at run time, `--enable-lora-loading`). Its record lives in that replica's
memory: if Ray restarts it, adapters already applied stay where they are, and later loads and
unloads are recorded afresh.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

BOOK_DEPLOYMENT = "gptserve-adapters"
LIVE_SECONDS = 10.0  # a replica not heard from for longer counts as gone
# base model -> adapter -> where it is read from (None: unloaded; replicas unload it)
Adapters = dict[str, dict[str, str | None]]


@dataclass
class _Replica:
    applied: int = 0  # the last version it has applied
    calls: int = 0  # its `sync` calls in progress
    seen: float = field(default_factory=time.monotonic)
    errors: dict[int, dict[str, str]] = field(default_factory=dict)  # version -> adapter -> error


class AdapterBook:
    """The adapters recorded at run time, by base model, with a version that each change
    raises (see the module's docstring)."""

    def __init__(self) -> None:
        self.version = 0
        self.adapters: Adapters = {}
        self.replicas: dict[str, _Replica] = {}
        self.changed = asyncio.Condition()

    async def record(self, base: str, name: str, source: str | None) -> int:
        """Record `name` on `base`, read from `source` (None: unloaded); returns the version."""
        async with self.changed:
            self.version += 1
            self.adapters.setdefault(base, {})[name] = source
            self.changed.notify_all()
            return self.version

    async def snapshot(self) -> tuple[int, Adapters]:
        return self.version, self.adapters

    async def sync(
        self, replica: str, applied: int, errors: dict[str, str], wait_s: float
    ) -> tuple[int, Adapters]:
        """A replica's long poll: it has applied `applied` (with these errors); returns the
        record once it is newer than that, or as it is after `wait_s` seconds. `errors`: the
        adapters it could not apply, with the reason."""
        seen = self.replicas.setdefault(replica, _Replica())
        seen.calls += 1
        seen.seen = time.monotonic()
        async with self.changed:
            if applied > seen.applied:
                seen.applied = applied
                if errors:
                    seen.errors[applied] = errors
                self.changed.notify_all()
            try:
                await asyncio.wait_for(
                    self.changed.wait_for(lambda: self.version > applied), wait_s
                )
            except asyncio.TimeoutError:
                pass
            finally:
                seen.calls -= 1
                seen.seen = time.monotonic()
            return self.version, self.adapters

    async def wait_applied(
        self, version: int, name: str, timeout: float
    ) -> tuple[list[str], list[str]]:
        """Wait (at most `timeout` seconds) until every live replica has applied `version`;
        returns what failed on the way for the adapter `name` (`replica: error`) and the
        replicas that had not applied it in time."""
        deadline = time.monotonic() + timeout
        async with self.changed:
            while self._behind(version) and time.monotonic() < deadline:
                try:  # woken by each replica's report; liveness is looked at every second
                    await asyncio.wait_for(self.changed.wait(), 1.0)
                except asyncio.TimeoutError:
                    pass
            failed = [
                f"replica {rid}: {errors[name]}"
                for rid, seen in self.replicas.items()
                for v, errors in seen.errors.items()
                if v >= version and name in errors
            ]
            return failed, self._behind(version)

    def _behind(self, version: int) -> list[str]:
        now = time.monotonic()
        return [
            rid
            for rid, seen in self.replicas.items()
            if seen.applied < version and (seen.calls or now - seen.seen < LIVE_SECONDS)
        ]
