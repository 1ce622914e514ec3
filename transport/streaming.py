"""Writing what a response producer yields, in the task that serves the connection.

The handler's async iterator is pulled and its items written in the same task, so a
streamed item costs no hand-off between tasks. Two helpers run beside it: one cancels
the stream when the client goes away, and for SSE a pinger writes a comment line when
nothing was written for ``ping_interval``. Writes are serialised by ``_WriteGate``: the
pinger never writes into the middle of an item, and never while an item's write waits
on a slow client.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any

import anyio

from .request import Request
from .sse import PING, frame_event

__all__ = ["discard", "pump"]

log = logging.getLogger("transport")

_ACLOSE_TIMEOUT = 5.0  # a producer's cleanup should be quick; never let it wedge a connection


class _WriteGate:
    """One write at a time, and when the last one ended (the pinger's clock)."""

    __slots__ = ("_write", "_free", "busy", "last", "failure")

    def __init__(self, write: Callable[[bytes], Awaitable[None]]) -> None:
        self._write = write
        self._free: anyio.Event | None = None
        self.busy = False
        self.last = time.monotonic()
        self.failure: Exception | None = None

    async def write(self, data: bytes) -> None:
        while self.busy:  # the pinger's write is waiting on the client
            self._free = free = anyio.Event()
            await free.wait()
        self.busy = True
        try:
            await self._write(data)
        finally:
            self.busy = False
            self.last = time.monotonic()
            if self._free is not None:
                self._free.set()
                self._free = None


async def pump(
    request: Request,
    source: AsyncIterable[Any],
    write: Callable[[bytes], Awaitable[None]],
    sse: bool,
    ping_interval: float,
) -> bool:
    """Write what ``source`` produces, one item at a time, until it ends.

    The stream is cancelled when the client goes away (``request.disconnected``) or a
    write fails; a write failure is re-raised here, a failure of the source is logged
    and ends the stream. Whatever ends it, an async generator is closed with
    ``aclose()`` (shielded, bounded), so its ``finally:`` runs while its owner still knows
    why it stopped. True when the source ended normally and every item was written.
    """
    iterator = aiter(source)
    gate = _WriteGate(write)
    ended = False
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
            if sse and math.isfinite(ping_interval):
                tg.start_soon(_pinger, gate, ping_interval, tg.cancel_scope)
            try:
                ended = await _write_items(iterator, gate, sse)
            except Exception as exc:  # re-raised bare, not wrapped in an exception group
                gate.failure = exc
            tg.cancel_scope.cancel()
    finally:
        await _aclose(iterator)
    if gate.failure is not None:
        raise gate.failure
    return ended and not request.is_disconnected()


async def _write_items(iterator: AsyncIterator[Any], gate: _WriteGate, sse: bool) -> bool:
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
        if data:
            await gate.write(data)


async def _pinger(gate: _WriteGate, interval: float, scope: anyio.CancelScope) -> None:
    """A comment line whenever nothing was written for ``interval``: keeps proxies and
    clients from timing out an idle stream."""
    while True:
        due = gate.last + interval - time.monotonic()
        if due > 0:
            await anyio.sleep(due)
            continue
        if gate.busy:  # an item's write is stalled: the send timeout deals with that
            await anyio.sleep(interval)
            continue
        try:
            await gate.write(PING)
        except Exception as exc:
            gate.failure = exc
            scope.cancel()
            return


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


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    await request.disconnected.wait()
    scope.cancel()
