"""Which Host headers a server answers: a guard against DNS rebinding on a loopback bind.

A server bound to 127.0.0.1 trusts that only this machine reaches it. A web page the user opens
can break that: its attacker's name is made to resolve to 127.0.0.1, and the page's scripts then
talk to the server as a same-origin site. Such a request still carries the attacker's name in its
Host header, so a loopback-bound server refuses requests whose Host is not a loopback name (as
Jupyter and other local servers do). `--allowed-host NAME` adds names (a reverse proxy that
forwards its own host name); `*` allows any. A server bound to another address is meant to be
reached by name, and answers any Host.
"""

from __future__ import annotations

import ipaddress

LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind address or a Host header's name, no port) is this machine only."""
    name = host.strip("[]").lower().rstrip(".")
    if name in LOOPBACK_NAMES or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(header: str) -> str:
    """A Host header's name without its port: `[::1]:8000` -> `::1`, `a.b:80` -> `a.b`."""
    header = header.strip()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else header[1:]
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def host_allowed(header: str | None, bind: str, allowed: list[str]) -> bool:
    """Whether a request with Host `header` is answered by a server bound to `bind`."""
    if not is_loopback(bind) or "*" in allowed:
        return True
    if header is None:  # HTTP/1.0 without Host: not a browser's request
        return True
    name = host_name(header).lower()
    return is_loopback(name) or name in (a.lower() for a in allowed)
