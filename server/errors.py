"""Every error leaves the server in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error"}


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message may quote client input (even lone surrogates)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered to the client; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or (
            "server_error" if status >= 500 else _TYPES.get(status, "invalid_request_error")
        )
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        return ErrorResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Pydantic's first complaint as a 400 naming the top-level body field (or the query or
    path parameter)."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ())]
    if first.get("type") == "json_invalid":
        return bad_request(f"the body is not valid JSON: {first.get('msg')}")
    if loc[:1] in (["query"], ["path"]) and len(loc) > 1:
        loc = loc[1:]
    elif loc[:1] == ["body"]:
        loc = loc[1:]
    if not loc:
        return bad_request(f"the body must be a JSON object: {first.get('msg')}")
    param = loc[0]
    message = f"invalid {param}: {first.get('msg')}"
    if len(loc) > 1:
        message += f" (at {'.'.join(loc)})"
    if first.get("type") == "missing":
        message = f"{param} is required"
    return bad_request(message, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Replace FastAPI's 422/HTTPException/500 answers with OpenAI-shaped ones."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = APIError(exc.status_code, str(exc.detail), code=code, headers=exc.headers)
        return err.response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return APIError(500, "internal server error", code="internal_error").response()
