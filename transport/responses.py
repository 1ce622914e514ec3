"""What a handler returns: bytes, JSON, a chunk stream, Server-Sent Events or a WebSocket."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any

import orjson

if TYPE_CHECKING:
    from .sse import SSEEvent
    from .websocket import WebSocket

__all__ = [
    "JSONResponse",
    "Response",
    "SSEResponse",
    "StreamResponse",
    "WebSocketResponse",
]

HeaderList = Iterable[tuple[str, str]] | None


class Response:
    """A complete response body sent with Content-Length."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        headers: HeaderList = None,
        content_type: str = "text/plain; charset=utf-8",
    ) -> None:
        self.status = status
        self.body = body
        self.headers: list[tuple[str, str]] = [("content-type", content_type)]
        if headers:
            self.headers.extend(headers)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.status}>"


class JSONResponse(Response):
    __slots__ = ()

    def __init__(self, obj: Any, status: int = 200, headers: HeaderList = None) -> None:
        super().__init__(orjson.dumps(obj), status, headers, "application/json")


class StreamResponse(Response):
    """A body produced chunk by chunk, sent with chunked transfer-encoding.

    Each chunk is written as soon as it is produced; a producer that outpaces the socket
    waits (it should coalesce), so memory stays bounded.
    """

    __slots__ = ("chunks",)

    def __init__(
        self,
        chunks: AsyncIterable[bytes],
        status: int = 200,
        headers: HeaderList = None,
        content_type: str = "application/octet-stream",
    ) -> None:
        super().__init__(b"", status, headers, content_type)
        self.chunks = chunks


class SSEResponse(StreamResponse):
    """Server-Sent Events: each item is one event's data payload (str or bytes), or an
    ``SSEEvent`` (a payload with an event type).

    The writer frames items (``data: ...\\n\\n``), sends ``: ping`` comments when the
    stream is idle for ``ServerConfig.sse_ping_interval``, and closes the producer with
    ``aclose()`` when the client goes away or stalls.
    """

    __slots__ = ()

    def __init__(
        self,
        events: AsyncIterable[bytes | str | SSEEvent],
        status: int = 200,
        headers: HeaderList = None,
    ) -> None:
        super().__init__(events, status, headers, "text/event-stream")  # type: ignore[arg-type]
        self.headers.append(("cache-control", "no-cache"))
        self.headers.append(("x-accel-buffering", "no"))


class WebSocketResponse(Response):
    """Accept a WebSocket upgrade and run ``session`` with the connected socket."""

    __slots__ = ("session", "subprotocol")

    def __init__(
        self,
        session: Callable[[WebSocket], Awaitable[None]],
        subprotocol: str | None = None,
    ) -> None:
        super().__init__(b"", 101)
        self.session = session
        self.subprotocol = subprotocol
