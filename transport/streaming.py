"""Writing what a response producer yields, in the task that serves the connection.

The handler's async iterator is pulled and its items written in the same task, so a
streamed item costs no hand-off between tasks, and no helper task runs beside it: the
client going away cancels the stream through a callback (``Request.on_disconnect``),
and SSE keep-alive pings are one more deadline the connection's watchdog checks
(``StreamGate.ping_due``): when nothing was written for ``ping_interval`` it starts one
``ping`` write. Writes are serialised by the ``StreamGate``: a ping never goes into the
middle of an item, nor while an item's write waits on a slow client.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from contextvars import ContextVar
from typing import Any

import anyio

from .request import Request
from .sse import PING, frame_event

__all__ = ["StreamGate", "current_gate", "discard", "pump"]

log = logging.getLogger("transport")

_ACLOSE_TIMEOUT = 5.0  # a producer's cleanup should be quick; never let it wedge a connection
_GATE: ContextVar[StreamGate | None] = ContextVar("transport_stream_gate", default=None)


def current_gate() -> StreamGate | None:
    """The gate of the streamed body whose producer is running (set by ``pump`` for the
    producer's own code, which runs in the connection's task), else None. A producer
    may write through it between its items (``ready_now``, then ``write_nowait``)."""
    return _GATE.get()


class StreamGate:
    """One write at a time for a streamed body, when the last one ended, and its pings."""

    __slots__ = (
        "_write", "_try_write", "_can_write", "_free", "busy", "last", "failure",
        "ping_interval", "_pinging", "scope",
    )  # fmt: skip

    def __init__(
        self,
        write: Callable[[bytes], Awaitable[None]],
        ping_interval: float = math.inf,
        try_write: Callable[[bytes], bool] | None = None,
        can_write: Callable[[], bool] | None = None,
    ) -> None:
        self._write = write
        # ``write`` without a coroutine when the socket takes the bytes at once (False:
        # nothing written, ``write`` waits); a streamed token costs no awaits that way.
        # ``can_write`` says beforehand whether it would.
        self._try_write = try_write
        self._can_write = can_write
        self._free: anyio.Event | None = None
        self.busy = False
        self.last = time.monotonic()
        self.failure: Exception | None = None
        self.ping_interval = ping_interval
        self._pinging = False
        self.scope: anyio.CancelScope | None = None  # the stream's, while it runs

    async def _wait_free(self) -> None:
        while self.busy:  # the other writer's write is waiting on the client
            self._free = free = anyio.Event()
            await free.wait()

    async def write(self, data: bytes) -> None:
        await self._wait_free()
        self.busy = True
        try:
            await self._write(data)
        finally:
            self.busy = False
            self.last = time.monotonic()
            if self._free is not None:
                self._free.set()
                self._free = None

    def ready_now(self) -> bool:
        """Whether ``write_nowait`` would write at once now: no write in progress, and
        the socket takes bytes without waiting. A producer that can make its next item
        synchronously asks this first (``current_gate``), so that nothing it makes is
        left unwritten."""
        can = self._can_write
        return not self.busy and self._try_write is not None and can is not None and can()

    def write_nowait(self, data: bytes) -> bool:
        """Write at once if no other write is in progress and the socket takes it now;
        False, with nothing written, when ``write`` must."""
        if self.busy or self._try_write is None or not self._try_write(data):
            return False
        self.last = time.monotonic()
        return True

    def ping_due(self, now: float) -> bool:
        """Whether the stream has been silent for ``ping_interval`` and a ping may start
        (not while a write is stalled on the client: the send timeout deals with that)."""
        return (
            self.scope is not None
            and not self.busy
            and not self._pinging
            and now - self.last >= self.ping_interval
        )

    async def ping(self) -> None:
        """Write one keep-alive comment; a failed write ends the stream with its error."""
        if not self.ping_due(time.monotonic()):
            return
        self._pinging = True
        try:
            await self.write(PING)
        except Exception as exc:
            self.failure = exc
            if self.scope is not None:
                self.scope.cancel()
        finally:
            self._pinging = False

    async def settle(self) -> None:
        """Stop pinging and wait for a ping's write in flight to end (it is bounded by
        the send timeout), so whatever the caller writes next is not interleaved."""
        self.scope = None
        await self._wait_free()


async def pump(request: Request, source: AsyncIterable[Any], gate: StreamGate, sse: bool) -> bool:
    """Write what ``source`` produces through ``gate``, one item at a time, until it ends.

    The stream is cancelled when the client goes away (``request.on_disconnect``) or a
    ping's write fails; a write failure is re-raised here, a failure of the source is
    logged and ends the stream. Whatever ends it, an async generator is closed with
    ``aclose()`` (shielded, bounded), so its ``finally:`` runs while its owner still knows
    why it stopped. True when the source ended normally and every item was written.
    """
    iterator = aiter(source)
    ended = False
    try:
        with anyio.CancelScope() as scope:
            gate.scope = scope
            forget = request.on_disconnect(scope.cancel)
            token = _GATE.set(gate)
            try:
                ended = await _write_items(iterator, gate, sse)
            finally:
                _GATE.reset(token)
                forget()
    finally:
        try:
            await _aclose(iterator)
        finally:
            with anyio.CancelScope(shield=True):
                await gate.settle()
    if gate.failure is not None:
        raise gate.failure
    return ended and not request.is_disconnected()


async def _write_items(iterator: AsyncIterator[Any], gate: StreamGate, sse: bool) -> bool:
    """Pull and write until the source ends (True) or fails (False, logged)."""
    while True:
        try:
            item = await anext(iterator)
        except StopAsyncIteration:
            return True
        except Exception:
            log.exception("response producer failed")
            return False
        data = frame_event(item) if sse else item
        if data and not gate.write_nowait(data):
            await gate.write(data)


async def _aclose(source: Any) -> None:
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + _ACLOSE_TIMEOUT
            try:
                await aclose()
            except Exception:
                log.exception("response producer failed while closing")


async def discard(source: AsyncIterable[Any]) -> None:
    """Close a producer that will never be pulled (HEAD, or the head write failed)."""
    aclose = getattr(source, "aclose", None)
    if aclose is not None:
        with anyio.CancelScope(shield=True) as scope:
            scope.deadline = anyio.current_time() + _ACLOSE_TIMEOUT
            await aclose()
