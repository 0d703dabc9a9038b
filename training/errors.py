"""The one error type of a training run."""

from __future__ import annotations


class TrainError(Exception):
    """A problem the user can fix; printed as one `error: ...` line, exit code 2."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code
