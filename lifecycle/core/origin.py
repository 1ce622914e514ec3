"""Where the call being made in this task came from: the incoming request, for observers
that want more of it than the call carries (the OpenTelemetry exporter keeps its path and
its raw headers, and reads the W3C ``traceparent`` from them off the event loop,
https://www.w3.org/TR/trace-context/#traceparent-header).

The HTTP router sets ``CALL_ORIGIN`` for the task that handles a request and resets it
when the handler returns; a call made in that task (or in a task it starts, which copies
the context) sees it when ``Frontend.call`` tells its call observers. The Engine sets
nothing: its calls have no origin. Setting it costs one context-variable write per HTTP
request; nothing reads it unless an observer asks.
"""

from __future__ import annotations

import uuid
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "CALL_ORIGIN",
    "DEFAULT_PUBLIC_ROUTES",
    "EXCHANGE",
    "REQUEST_ID_HEADER",
    "Exchange",
    "Origin",
    "client_request_id",
    "current_request_id",
    "new_request_id",
]

REQUEST_ID_HEADER = "x-request-id"
# The routes that need no API key unless --public-route / --no-public-routes say otherwise.
DEFAULT_PUBLIC_ROUTES: tuple[str, ...] = ("/health", "/metrics")
_MAX_ID = 128  # characters of a client's X-Request-Id kept; a longer one is replaced


class _Headers(Protocol):
    @property
    def raw(self) -> list[tuple[bytes, bytes]]:
        """(lower-cased name, value) pairs as received; never changed afterwards."""
        ...


class Origin(Protocol):
    """What a call's observers may ask of the request it came from (``transport.Request``)."""

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> _Headers: ...


CALL_ORIGIN: ContextVar[Origin | None] = ContextVar("lifecycle_call_origin", default=None)


def new_request_id() -> str:
    """A request id for a request whose client named none (32 hex digits)."""
    return uuid.uuid4().hex


def client_request_id(value: str | None) -> str | None:
    """A client's ``X-Request-Id`` as the server adopts it: trimmed, 1 to 128 printable
    ASCII characters; None (the server then makes one) for anything else."""
    if value is None:
        return None
    value = value.strip()
    if 0 < len(value) <= _MAX_ID and value.isascii() and value.isprintable():
        return value
    return None


@dataclass(slots=True)
class Exchange:
    """One HTTP exchange as the calls made for it see it (``EXCHANGE``): its request id
    (``X-Request-Id``), route template and client address. The router makes it before
    the handler runs; ``headers`` is the request's extra response headers (the transport's
    ``Request.response_headers``), whose first pair is the ``X-Request-Id`` every answer
    carries."""

    id: str
    given: bool  # the client named it (its X-Request-Id, or the body's rid adopted)
    route: str | None = None
    client: str | None = None
    headers: list[tuple[str, str]] | None = None
    calls: int = 0  # generate calls made for it (a rejection counts as one)
    # A WebSocket session: each generation on it is a request of its own, with its own id
    # (its rid, else a new one); the exchange gives them only their route and client.
    per_call: bool = False

    def adopt(self, rid: str) -> None:
        """The body's ``rid`` names the exchange when the client sent no X-Request-Id
        (SGLang clients name requests that way); a header the client sent wins."""
        if self.given or self.per_call:
            return
        self.id, self.given = rid, True
        if self.headers:
            self.headers[0] = (REQUEST_ID_HEADER, rid)


# Set by the HTTP router for the task that handles a request; None for the Engine.
EXCHANGE: ContextVar[Exchange | None] = ContextVar("lifecycle_exchange", default=None)


def current_request_id() -> str:
    """The request id of the exchange being handled, else a new one (the response ids
    ``chatcmpl-{id}``, ``cmpl-{id}``, ``resp_{id}``, ``msg_{id}`` are made from it)."""
    ex = EXCHANGE.get()
    return ex.id if ex is not None else new_request_id()
