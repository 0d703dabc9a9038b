"""Stored responses: what `previous_response_id` continues and `GET /v1/responses/{id}` returns.

In memory, per tenant (the API key's, `server.tenancy`; without keys every client is the one
tenant), least recently used dropped first once a tenant holds `per_tenant` responses or
`max_bytes` of them. Another tenant's id is as unknown as one never stored.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # per tenant: the JSON of its responses and conversations


@dataclass(frozen=True)
class StoredResponse:
    body: dict[str, Any]  # the response object, as answered
    conversation: list[dict[str, Any]]  # its input items (after any earlier ones) and its output
    size: int  # bytes of JSON, counted against the tenant's bound
    inputs: int = 0  # how many of `conversation` are its input items (input_items lists them)


class ResponseStore:
    """A bounded LRU of responses for each tenant."""

    def __init__(self, per_tenant: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.per_tenant = per_tenant
        self.max_bytes = max_bytes
        self._tenants: dict[str | None, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str | None, int] = {}

    def put(
        self, tenant: str | None, body: dict[str, Any], conversation: list[dict[str, Any]],
        inputs: int = 0,
    ) -> bool:  # fmt: skip
        """Keep a response (by its id) and its conversation, the first `inputs` items of it
        the response's input; False when the bounds leave no room for it."""
        size = len(json.dumps(body)) + len(json.dumps(conversation))
        if self.per_tenant < 1 or size > self.max_bytes:
            return False
        kept = self._tenants.setdefault(tenant, OrderedDict())
        self.delete(tenant, body["id"])
        kept[body["id"]] = StoredResponse(body, conversation, size, inputs)
        self._bytes[tenant] = self._bytes.get(tenant, 0) + size
        while len(kept) > self.per_tenant or self._bytes[tenant] > self.max_bytes:
            _, dropped = kept.popitem(last=False)
            self._bytes[tenant] -= dropped.size
        return True

    def get(self, tenant: str | None, response_id: str) -> StoredResponse | None:
        kept = self._tenants.get(tenant)
        if kept is None or response_id not in kept:
            return None
        kept.move_to_end(response_id)
        return kept[response_id]

    def delete(self, tenant: str | None, response_id: str) -> bool:
        kept = self._tenants.get(tenant)
        if kept is None or response_id not in kept:
            return False
        self._bytes[tenant] -= kept.pop(response_id).size
        return True

    def __len__(self) -> int:
        return sum(len(kept) for kept in self._tenants.values())
