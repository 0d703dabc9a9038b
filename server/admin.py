"""The admin scope: which requests may change what the server serves.

A key given with --admin-api-key (or GPTSERVE_ADMIN_API_KEYS) is an admin key; it is also a valid
key for every other endpoint. AdmissionControl (server.app) marks each request in the ASGI scope
under ADMIN_SCOPE_KEY, so handlers learn whether the key is an admin's without seeing the key:

- no API key configured (an open server): every client is an admin, as before the scope existed;
- API keys configured: only a request with an admin key; with no admin key configured, nobody.

An endpoint that needs the scope takes `dependencies=[Depends(require_admin)]` (or awaits it),
which answers 403 `permission_denied` to everyone else; `is_admin` says which it is, for answers
that differ (an admin's may name server paths, another key's never do).
"""

from __future__ import annotations

import logging

from gptserve.server.errors import APIError
from gptserve.server.settings import ADMIN_API_KEYS_ENV, Settings
from starlette.requests import HTTPConnection

log = logging.getLogger(__name__)

# where AdmissionControl (server.app) leaves whether the request may act as an admin
ADMIN_SCOPE_KEY = "gptserve.admin"


def is_admin(request: HTTPConnection) -> bool:
    """Whether the request's key is an admin's (every request is, on a server with no keys); a
    request that never passed AdmissionControl is not."""
    return request.scope.get(ADMIN_SCOPE_KEY) is True


def permission_denied() -> APIError:
    return APIError(
        403, "this endpoint needs an admin API key (the server's --admin-api-key)",
        code="permission_denied", type="permission_error",
    )  # fmt: skip


async def require_admin(request: HTTPConnection) -> None:
    """A FastAPI dependency: 403 `permission_denied` unless the request may act as an admin."""
    if not is_admin(request):
        raise permission_denied()


def warn_about_admin_scope(settings: Settings) -> None:
    """Log at start what --enable-lora-loading will refuse for lack of an admin key or a root."""
    if not settings.enable_lora_loading:
        return
    if settings.auth_keys and not settings.admin_api_keys:
        log.warning(
            "--enable-lora-loading with API keys but no admin key: /v1/load_lora_adapter and "
            "/v1/unload_lora_adapter answer 403 to every key; set --admin-api-key KEY (or %s)",
            ADMIN_API_KEYS_ENV,
        )
    if not settings.lora_roots:
        log.warning(
            "--enable-lora-loading without --lora-root: /v1/load_lora_adapter refuses every "
            "lora_path; set --lora-root DIR to the directory the adapters are loaded from"
        )
