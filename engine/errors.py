"""The one error a request gets from the engine's side: `RequestError`, naming the field at fault."""

from __future__ import annotations


class RequestError(ValueError):
    """A request the engine cannot take: `param` names the field at fault (as the client sent
    it), `code` the kind where there is one (`context_length_exceeded`, ...). The message is one
    line and begins with what is wrong; the server answers it with a 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
