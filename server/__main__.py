"""`python -m server`: load the checkpoint, then serve it with uvicorn until SIGTERM/SIGINT.

Errors in flags or the checkpoint print one `error: ...` line and exit with status 2. On SIGTERM
the server stops accepting connections, lets in-flight requests finish for --shutdown-grace
seconds (then cancels them), stops the engine thread and exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn

from model.cpu_memory import retain_freed_memory
from server.app import create_app
from server.settings import SettingsError, settings_from_args
from server.state import ModelLoadError, load_model_in_thread


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(argv)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    retain_freed_memory()  # a process-wide malloc setting: the entry point's to make
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        loaded = load_model_in_thread(settings)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    app = create_app(settings, loaded)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=settings.shutdown_grace,
        access_log=settings.log_level == "debug",
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises a caught SIGTERM/SIGINT after its graceful shutdown; with these no-op
    # handlers in place that re-raise is harmless and a drained server exits 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    except OSError as exc:  # e.g. the port is taken
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if server.started else 2


if __name__ == "__main__":
    sys.exit(main())
