"""The two error families, like h11's local and remote protocol errors.

``RequestError``: the client got the request wrong; it carries its 4xx status and a
message to show. ``ServeError``: the server side ended the request (not ready,
overloaded, worker lost, shutting down); it carries the cause, and the cause its status.
Our own faults are any other exception: a 500, logged with context, never shown.
"""

from __future__ import annotations

from lifecycle.core.states import Cause

__all__ = ["RequestError", "ServeError"]


class RequestError(Exception):
    """A request the client got wrong: becomes a 4xx with ``message`` as the error text.

    ``cause`` is the error cause the request's state machine ends with (``invalid``, or
    ``too_long`` for the context-length checks).
    """

    status: int = 400

    def __init__(self, message: str, status: int = 400, cause: Cause = Cause.INVALID) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.cause = cause


class ServeError(Exception):
    """A request ended by the server side (not ready, overloaded, worker lost, ...)."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.message = message
