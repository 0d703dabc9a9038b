"""`gptserve serve`: bind the port, load the checkpoint behind it, serve until SIGTERM/SIGINT.

The port is bound before the model loads, so `/health` answers 503 "loading" over HTTP while a
large checkpoint loads. Bad flags, a missing checkpoint directory, an unavailable device or a port
that cannot be bound print one `error: ...` line and exit with status 2 before anything loads; a
checkpoint that fails while loading stops the server, and the process ends with the same
`error: ...` line and status 2. With --exit-on-engine-failure an engine that turns unhealthy
(too many failed steps in a row) or dies stops the server too, which ends with an `error: ...`
line and status 1, for a process manager to restart it. On SIGTERM the server stops accepting
connections, lets in-flight requests finish for --shutdown-grace seconds (then cancels them),
stops the engine thread and exits 0.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

import uvicorn
from gptserve.server.app import create_app
from gptserve.server.hosts import is_loopback
from gptserve.server.logging_setup import setup_logging, uvicorn_log_config
from gptserve.server.runtime import ModelLoadError, preflight, process_seconds
from gptserve.server.settings import API_KEYS_ENV, Settings, SettingsError, settings_from_args
from gptserve.server.tracing import TracingUnavailable, check_tracing


def bind(settings: Settings) -> socket.socket:
    """The listening socket, bound before anything loads; raises OSError."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((settings.host, settings.port))
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(argv)
        check_tracing(settings.otlp_traces_endpoint)
        preflight(settings)
    except (SettingsError, ModelLoadError, TracingUnavailable) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        sock = bind(settings)
    except OSError as exc:  # the port is taken, the address is not this machine's, ...
        print(f"error: cannot bind {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)  # text or JSON, with request ids
    if not is_loopback(settings.host) and not settings.auth_keys:
        logging.getLogger("server").warning(
            "binding %s with no API key: anyone who can reach this port can use the model; "
            "set --api-key KEY (or %s)", settings.host, API_KEYS_ENV,
        )  # fmt: skip
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_grace,
        access_log=settings.log_level == "debug",
        **uvicorn_log_config(settings.log_format),
    )
    server = uvicorn.Server(config)
    state = app.state.server
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    age = process_seconds()
    logging.getLogger("server").info(
        "listening on http://%s:%d %s; loading %s", host, sock.getsockname()[1],
        "" if age is None else f"{age:.1f} s after start (the imports)", settings.model_path,
    )  # fmt: skip

    def stop_serving(message: str) -> None:  # called in the loader or the engine thread
        server.should_exit = True

    if not settings.serves_many:  # with several models a failed load fails its requests only
        state.on_load_error = stop_serving
    if settings.exit_on_engine_failure:  # the engine has already failed its requests
        state.on_engine_failure = stop_serving
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown; with these no-op
    # handlers in place that re-raise is harmless and a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[sock])
    code = 0 if server.started else 2
    if state.load_error is not None:
        print(f"error: {state.load_error}", file=sys.stderr)
        code = 2
    elif settings.exit_on_engine_failure and state.engine_failure is not None:
        print(f"error: {state.engine_failure}", file=sys.stderr)
        code = 1
    if state.loader_thread is not None and state.loader_thread.is_alive():
        # stopped while the checkpoint was still loading: torch's threads cannot be torn down
        # at interpreter exit under a running load, so leave without waiting for it
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
