"""The server's logging: `--log-format text` (the default: `time LEVEL logger: message`, with the
request's id after the logger's name on a request's lines) or `json` (one JSON object a line).

A JSON line has `time` (ISO-8601, UTC), `level`, `logger`, `message`, `request_id` when the line
is about a request, `exception` with a traceback, and every field the call passed in `extra`
(the "finished" line of `server.request_log` passes model, token counts, timings and status).
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

from gptserve.server.request_ids import RequestIdFilter

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TEXT_WITH_ID = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# a record's own attributes; any other is a field the call passed in `extra` (but uvicorn's
# color_message, its message with terminal colours)
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {
    "message", "asctime", "request_id", "taskName", "color_message",
}  # fmt: skip


class TextFormatter(logging.Formatter):
    """`time LEVEL logger: message`, and `time LEVEL logger [request id]: message` for a
    request's lines."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._with_id = logging.Formatter(_TEXT_WITH_ID)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None):
            return self._with_id.format(record)
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object a line (see the module's docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None)
        if request_id:
            out["request_id"] = request_id
        for key, value in vars(record).items():
            if key not in _RECORD_FIELDS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def log_handler(log_format: str = "text") -> logging.Handler:
    """A stderr handler in `log_format` that adds each record's request id."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    return handler


def setup_logging(level: str, log_format: str = "text") -> None:
    """The root logger at `level` ("info", ...) with one such handler on stderr, as
    `logging.basicConfig` sets it (nothing changes when the root logger has handlers already)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} is not one of {', '.join(LOG_FORMATS)}")
    logging.basicConfig(level=level.upper(), handlers=[log_handler(log_format)])


def uvicorn_log_config(log_format: str) -> dict[str, Any]:
    """uvicorn.Config's logging arguments: with JSON, uvicorn's own lines go through the root
    logger (one JSON object a line); with text, they keep uvicorn's format."""
    return {"log_config": None} if log_format == "json" else {}
