"""The request object handlers receive, its headers, and the body queue behind it."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any
from urllib.parse import parse_qs

import anyio
import orjson

from .errors import HTTPError

__all__ = ["BodyQueue", "Headers", "Request"]


class Headers:
    """Request headers as h11 delivers them (names lower-cased), looked up case-insensitively."""

    __slots__ = ("_map", "raw")

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = raw
        self._map: dict[str, str] | None = None

    def _lookup(self) -> dict[str, str]:
        if self._map is None:
            # Repeated headers join with ", " (RFC 9110 section 5.3); h11 already lower-cases names.
            merged: dict[str, str] = {}
            for name, value in self.raw:
                key, text = name.decode("latin-1"), value.decode("latin-1")
                merged[key] = f"{merged[key]}, {text}" if key in merged else text
            self._map = merged
        return self._map

    def get(self, name: str, default: str | None = None) -> str | None:
        return self._lookup().get(name.lower(), default)

    def get_all(self, name: str) -> list[str]:
        key = name.lower().encode("latin-1")
        return [v.decode("latin-1") for n, v in self.raw if n == key]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._lookup()

    def __iter__(self) -> Iterator[str]:
        return iter(self._lookup())

    def __len__(self) -> int:
        return len(self._lookup())

    def items(self) -> list[tuple[str, str]]:
        return [(n.decode("latin-1"), v.decode("latin-1")) for n, v in self.raw]

    def __repr__(self) -> str:
        return f"Headers({self.items()!r})"


class BodyQueue:
    """Body chunks handed from the connection's reader to the handler, bounded.

    The reader ``push``es what h11 parses and waits in ``wait_for_space`` while more than
    ``high_water`` bytes are unread, so a handler that does not read stops the socket
    reads instead of growing memory.
    """

    __slots__ = (
        "_changed",
        "_chunks",
        "_done",
        "_error",
        "_space",
        "_total",
        "_unread",
        "high_water",
        "limit",
    )

    def __init__(self, limit: int, high_water: int = 65536) -> None:
        self.limit = limit
        self.high_water = high_water
        self._chunks: deque[bytes] = deque()
        self._total = 0
        self._unread = 0
        self._done = False
        self._error: HTTPError | None = None
        self._changed: anyio.Event | None = None
        self._space: anyio.Event | None = None

    @property
    def finished(self) -> bool:
        return self._done or self._error is not None

    def push(self, data: bytes) -> bool:
        """Queue a chunk; False (and the queue fails with 413) once the body exceeds the limit."""
        self._total += len(data)
        if self._total > self.limit:
            self.fail(HTTPError(413, f"Request body exceeds {self.limit} bytes"))
            return False
        self._chunks.append(data)
        self._unread += len(data)
        self._wake()
        return True

    def finish(self) -> None:
        self._done = True
        self._wake()

    def fail(self, error: HTTPError) -> None:
        if not self._done and self._error is None:
            self._error = error
            self._chunks.clear()
            self._unread = 0
            self._wake()
            self._make_space()

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def _make_space(self) -> None:
        if self._space is not None:
            self._space.set()
            self._space = None

    async def wait_for_space(self) -> None:
        while self._unread > self.high_water and not self.finished:
            self._space = anyio.Event()
            await self._space.wait()

    async def pull(self) -> bytes | None:
        """Next chunk, None at the end; raises the HTTPError the body failed with."""
        while True:
            if self._chunks:
                chunk = self._chunks.popleft()
                self._unread -= len(chunk)
                self._make_space()
                return chunk
            if self._error is not None:
                raise self._error
            if self._done:
                return None
            self._changed = anyio.Event()
            await self._changed.wait()


class Request:
    """One HTTP request as a handler sees it.

    ``disconnected`` is set by the connection's reader when the client goes away (EOF or
    reset), so a handler waiting on something else learns of it without writing.

    A handler either returns its response, or sends it itself with ``await
    request.respond(response)`` and then returns that same response: a stream is then
    written while the handler's own scopes (``async with``, cancel scopes) are still open,
    so whatever it owns is released when it leaves them, however the stream ended.
    """

    __slots__ = (
        "_body",
        "_cached",
        "_on_first_pull",
        "_on_watch",
        "_on_gone",
        "_responder",
        "responded",
        "response_headers",
        "client",
        "_disconnected",
        "disconnect_reason",
        "headers",
        "http_version",
        "method",
        "path",
        "path_params",
        "query_string",
        "user",
    )

    def __init__(
        self,
        method: str,
        target: str,
        headers: Headers,
        client: tuple[str, int] | None = None,
        body: BodyQueue | None = None,
        http_version: str = "1.1",
    ) -> None:
        self.method = method
        path, _, self.query_string = target.partition("?")
        self.path = path
        self.headers = headers
        self.client = client
        self.http_version = http_version
        self.path_params: dict[str, str] = {}
        self._disconnected: anyio.Event | None = None  # made on first use: most never need it
        self.disconnect_reason: str | None = None
        self._body = body
        self._cached: bytes | None = None if body is not None else b""
        self._on_first_pull: Callable[[], Awaitable[None]] | None = None
        # Set by the connection: the first look at ``disconnected`` starts its watcher.
        self._on_watch: Callable[[Request], None] | None = None
        self._on_gone: list[Callable[[], object]] | None = None
        # Set by the connection: writes a response from inside the handler (``respond``).
        self._responder: Callable[[Request, Any], Awaitable[bool]] | None = None
        self.responded: Any = None  # the response ``respond`` sent, if any
        # Extra headers for whatever answers this request (the handler's response, one it
        # sends with ``respond``, an error response, a WebSocket's 101), added when its
        # head is written: the app may set or change them until then (docs/transport.md).
        self.response_headers: list[tuple[str, str]] | None = None
        # Who the app's authentication says sent this (the app sets it; the transport never).
        self.user: Any = None

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path!r}>"

    def query(self) -> dict[str, list[str]]:
        return parse_qs(self.query_string, keep_blank_values=True)

    @property
    def disconnected(self) -> anyio.Event:
        if self._disconnected is None:
            self._disconnected = anyio.Event()
            if self._on_watch is not None:
                self._on_watch(self)
        return self._disconnected

    def is_disconnected(self) -> bool:
        return self._disconnected is not None and self._disconnected.is_set()

    def mark_disconnected(self, reason: str) -> None:
        """Record why the client is gone (first reason wins) and wake whoever waits."""
        if self.disconnect_reason is None:
            self.disconnect_reason = reason
        if self._disconnected is None:  # not via the property: nobody needs a watcher now
            self._disconnected = anyio.Event()
        self._disconnected.set()
        callbacks, self._on_gone = self._on_gone, None
        for callback in callbacks or ():
            callback()

    def on_disconnect(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Call ``callback`` (sync, once) when the client goes away; at once if it has.

        What waiting on ``disconnected`` in a task of its own does, without the task (e.g.
        ``on_disconnect(scope.cancel)``). Returns a function that takes the callback back.
        """
        if self.disconnected.is_set():  # the property also starts the connection's watcher
            callback()
            return _nothing
        if self._on_gone is None:
            self._on_gone = []
        self._on_gone.append(callback)

        def remove() -> None:
            if self._on_gone is not None and callback in self._on_gone:
                self._on_gone.remove(callback)

        return remove

    async def respond(self, response: Any) -> Any:
        """Send ``response`` now, from inside the handler, and return it once it is written
        to the end (or the client is gone: ``is_disconnected()`` then says so). The handler
        returns it afterwards; a request can be answered once."""
        if self.responded is not None:
            raise RuntimeError(f"{self!r} was already answered")
        if self._responder is None:
            raise RuntimeError("respond() needs a connection (the transport sets it)")
        self.responded = response
        await self._responder(self, response)
        return response

    async def stream(self) -> AsyncIterator[bytes]:
        if self._cached is not None:
            if self._cached:
                yield self._cached
            return
        assert self._body is not None
        if self._on_first_pull is not None:
            hook, self._on_first_pull = self._on_first_pull, None
            await hook()
        while (chunk := await self._body.pull()) is not None:
            yield chunk
        self._cached = b""  # consumed: a second read sees an empty body, never a hang

    async def body(self) -> bytes:
        if self._cached is None:
            self._cached = b"".join([chunk async for chunk in self.stream()])
        return self._cached

    async def json(self) -> Any:
        data = await self.body()
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise HTTPError(400, f"Invalid JSON: {exc}") from None


def _nothing() -> None:
    pass
