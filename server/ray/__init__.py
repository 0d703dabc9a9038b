"""Ray Serve: engine replicas behind Ray Serve's HTTP proxy (needs the `ray` extra).

`cli.py` is `gptserve ray` and Ray Serve's application builder (`serve run server.ray:app`
or `server.ray:build_app key=value ...`), `deployment.py` the replica deployment and its scale
options, `proxy_middleware.py` the middleware that Ray's HTTP proxy runs before a replica. See
docs/DEPLOY.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def build_app(args: Mapping[str, Any] | None = None) -> Any:
    """Ray Serve's application builder: `serve run server.ray:build_app key=value ...`."""
    from gptserve.server.ray.cli import build_app as build

    return build(args)


def __getattr__(name: str) -> Any:  # `server.ray:app`, built when asked for
    if name == "app":
        return build_app({})
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
