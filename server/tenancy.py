"""Who shares the prefix cache: a request's cache salt, from its API key and its `cache_salt`.

A prompt prefix found in the prefix cache shows: `usage.prompt_tokens_details.cached_tokens`
counts it to the token, and the time to first token drops with it. A client that could hit
another client's cached blocks could therefore test guesses of what that client sent. The engine
lets requests share blocks only when their salts are equal (`engine.prefix_index`); this module
gives every request its salt:

- `--prefix-cache-scope key` (the default): the tenant is the API key the request was
  authenticated with; with no `--api-key` configured every client is the one tenant;
- `--prefix-cache-scope global`: every client is the one tenant;
- a request's `cache_salt` (vLLM's field) narrows its tenant further: callers who share a key
  but not their prompts send different salts.
"""

from __future__ import annotations

import hashlib
import json

# where AdmissionControl (server.app) leaves the authenticated key's tenant in the ASGI scope
TENANT_SCOPE_KEY = "gptserve.tenant"
SCOPES = ("key", "global")


def key_tenant(key: bytes) -> str:
    """An API key's tenant id: a digest, so the key itself goes no further than AdmissionControl."""
    return hashlib.sha256(b"gptserve tenant\0" + key).hexdigest()[:32]


def request_cache_salt(scope: str, tenant: str | None, cache_salt: str | None) -> str | None:
    """The engine's cache salt for a request of `tenant` (None: no key) that sent `cache_salt`;
    None when it shares the unsalted cache with every other such request."""
    if scope not in SCOPES:
        raise ValueError(f"unknown prefix cache scope {scope!r}")
    if scope == "global":
        tenant = None
    if tenant is None and cache_salt is None:
        return None
    # JSON keeps ("a", "b|c") and ("a|b", "c") apart; the digest keeps the salt short
    return hashlib.sha256(json.dumps([tenant, cache_salt]).encode()).hexdigest()
