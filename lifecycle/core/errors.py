"""The client's-fault error family: it carries its HTTP status and a message to show."""

from __future__ import annotations

from lifecycle.core.states import Cause

__all__ = ["RequestError"]


class RequestError(Exception):
    """A request the client got wrong: becomes a 4xx with ``message`` as the error text.

    ``cause`` is the error cause the request's state machine ends with (``invalid``, or
    ``too_long`` for the context-length checks). Our own faults are any other exception:
    a 500, logged with context, never shown.
    """

    status: int = 400

    def __init__(self, message: str, status: int = 400, cause: Cause = Cause.INVALID) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.cause = cause
