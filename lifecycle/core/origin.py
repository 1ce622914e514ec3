"""Where the calls being made in this task came from: the HTTP exchange, one value.

The HTTP router makes an ``Origin`` for each request before the handler runs, sets it
in ``ORIGIN`` for the handler's task and resets it when the handler returns; a call made
in that task (or in a task it starts, which copies the context) takes it when it is
made. It carries what every reader needs of the exchange: its request id (the client's
``X-Request-Id``, else the body's ``rid``, else a new one), route template, client
address, the response headers that carry the id back, the generate calls made for it,
the incoming request (its raw headers, read for ``X-Request-Timeout`` and by the
OpenTelemetry exporter for the W3C ``traceparent``,
https://www.w3.org/TR/trace-context/#traceparent-header), and the calls the access log
writes a line for. A WebSocket session gets one of its own for its generations
(``per_call``). The Engine sets nothing: its calls have no origin. Setting it costs one
context-variable write per HTTP request.
"""

from __future__ import annotations

import time
import uuid
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

__all__ = [
    "DEFAULT_PUBLIC_ROUTES",
    "ORIGIN",
    "REQUEST_ID_HEADER",
    "HttpRequest",
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


class HttpRequest(Protocol):
    """What the core reads of the incoming request (``transport.Request``)."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str: ...

    @property
    def headers(self) -> _Headers: ...

    @property
    def client(self) -> tuple[str, int] | None: ...


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
class Origin:
    """One HTTP exchange as the calls made for it, the router and the access log see it
    (``ORIGIN``). ``headers`` is the request's extra response headers (the transport's
    ``Request.response_headers``), whose first pair is the ``X-Request-Id`` every answer
    carries."""

    request: HttpRequest
    id: str
    given: bool  # the client named it (its X-Request-Id, or the body's rid adopted)
    route: str | None = None
    headers: list[tuple[str, str]] | None = None
    calls: int = 0  # generate calls made for it (a rejection counts as one)
    # A WebSocket session: each generation on it is a request of its own, with its own id
    # (its rid, else a new one) and no header of the upgrade; the session's origin gives
    # them only their route and client.
    per_call: bool = False
    started: float = field(default_factory=time.monotonic)  # the access log's total_ms
    logged: list[Any] | None = None  # the calls the access log writes (None: it does not)

    @property
    def client(self) -> str | None:
        """The client's address, ``host:port``."""
        c = self.request.client
        return f"{c[0]}:{c[1]}" if c else None

    @property
    def call_request(self) -> HttpRequest | None:
        """The HTTP request the calls made for it came from (their ``X-Request-Timeout``,
        their trace parent); None in a WebSocket session, whose upgrade is not theirs."""
        return None if self.per_call else self.request

    def session(self) -> Origin:
        """The origin of a WebSocket session's generations (``per_call``)."""
        return Origin(self.request, self.id, self.given, self.route, per_call=True)

    def adopt(self, rid: str) -> None:
        """The body's ``rid`` names the exchange when the client sent no X-Request-Id
        (SGLang clients name requests that way); a header the client sent wins."""
        if self.given or self.per_call:
            return
        self.id, self.given = rid, True
        if self.headers:
            self.headers[0] = (REQUEST_ID_HEADER, rid)


# Set by the HTTP router for the task that handles a request; None for the Engine.
ORIGIN: ContextVar[Origin | None] = ContextVar("lifecycle_origin", default=None)


def current_request_id() -> str:
    """The request id of the exchange being handled, else a new one (the response ids
    ``chatcmpl-{id}``, ``cmpl-{id}``, ``resp_{id}``, ``msg_{id}`` are made from it)."""
    origin = ORIGIN.get()
    return origin.id if origin is not None else new_request_id()
