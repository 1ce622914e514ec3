"""Errors a handler (or the transport itself) turns into an HTTP response."""

from __future__ import annotations

from http import HTTPStatus

import orjson

__all__ = ["HTTPError", "error_body", "reason_phrase"]


def reason_phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def error_body(message: str) -> bytes:
    """The JSON error shape every transport-made error uses, so API clients can parse it."""
    return orjson.dumps({"error": {"message": message}})


class HTTPError(Exception):
    """Raised by handlers or by :class:`~transport.Request` methods; becomes a response.

    ``body`` may be raw bytes (sent as is), a dict (sent as JSON), a string (wrapped in the
    standard JSON error shape) or None (the status's reason phrase in that shape).
    """

    def __init__(
        self,
        status: int,
        body: bytes | dict | str | None = None,
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.status = status
        self.headers = list(headers or ())
        if body is None:
            body = reason_phrase(status)
        if isinstance(body, str):
            self.message = body
            self.body = error_body(body)
            self.content_type = "application/json"
        elif isinstance(body, dict):
            self.message = str(body.get("error", body))
            self.body = orjson.dumps(body)
            self.content_type = "application/json"
        else:
            self.message = body.decode("utf-8", "replace")
            self.body = body
            self.content_type = "text/plain; charset=utf-8"
        super().__init__(status, self.message)
