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

from contextvars import ContextVar
from typing import Protocol

__all__ = ["CALL_ORIGIN", "Origin"]


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
