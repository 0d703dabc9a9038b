"""Errors on Ollama's paths (/api/...) in Ollama's shape: `{"error": "message"}`, same status
(400 a bad request, 401 a missing key, 404 an unknown model or route, 500 and 503 the server's).

`OllamaErrorShape` wraps the whole app (server.error_shapes), so the gate's 401/413/429/408 and
FastAPI's own 404/405 are reshaped too.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from gptserve.server.error_shapes import ErrorShape

PREFIX = "/api/"


def ollama_error(message: str) -> dict[str, Any]:
    return {"error": message}


def is_ollama_path(path: str) -> bool:
    return path.startswith(PREFIX)


# ASGI middleware: error answers under /api/ in Ollama's shape
OllamaErrorShape = partial(
    ErrorShape, matches=is_ollama_path, shape=lambda status, message, code: ollama_error(message)
)
