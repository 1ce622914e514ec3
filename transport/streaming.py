"""Running a response producer beside the writer: one item in flight, cancel-safe waits."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import anyio

from .request import Request
from .sse import PING, frame_event

__all__ = ["END", "Mailbox", "discard", "pump", "run_producer"]

log = logging.getLogger("transport")

END: Any = object()  # returned by Mailbox.get once the producer is finished
_ACLOSE_TIMEOUT = 5.0  # a producer's cleanup should be quick; never let it wedge a connection


class Mailbox:
    """A one-item hand-off from a producer task to the writer.

    Unlike a memory object stream, a cancelled ``get`` (the writer's ping timer) never
    loses an item: the item stays in the box until it is taken. ``put`` returns only once
    the writer took the item, so at most one produced item is ever waiting.
    """

    __slots__ = ("_items", "_space", "_wake", "closed", "failed")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._wake: anyio.Event | None = None
        self._space: anyio.Event | None = None
        self.closed = False
        self.failed = False

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()
            self._wake = None

    async def put(self, item: Any) -> None:
        self._items.append(item)
        self._notify()
        while self._items:
            self._space = anyio.Event()
            await self._space.wait()

    def close(self, failed: bool = False) -> None:
        self.closed = True
        self.failed = self.failed or failed
        self._notify()

    async def get(self) -> Any:
        while not self._items:
            if self.closed:
                return END
            self._wake = anyio.Event()
            await self._wake.wait()
        item = self._items.popleft()
        if self._space is not None:
            self._space.set()
            self._space = None
        return item


async def run_producer(source: AsyncIterable[Any], box: Mailbox) -> None:
    """Pull items from ``source`` into ``box`` until it ends, fails or is cancelled.

    Whatever ends it, an async generator is closed with ``aclose()`` (shielded, bounded),
    so the producer's ``finally:`` runs while its owner still knows why it stopped.
    """
    iterator = aiter(source)
    failed = False
    try:
        while True:
            try:
                item = await anext(iterator)
            except StopAsyncIteration:
                break
            await box.put(item)
    except Exception:
        failed = True
        log.exception("response producer failed")
    finally:
        box.close(failed)
        aclose = getattr(iterator, "aclose", None)
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


async def pump(
    request: Request,
    source: AsyncIterable[Any],
    write: Callable[[bytes], Awaitable[None]],
    sse: bool,
    ping_interval: float,
) -> bool:
    """Write what ``source`` produces, one item at a time, until it ends.

    The producer runs in its own task so that an idle SSE stream can still send pings.
    It is cancelled when the client goes away (``request.disconnected``) or when a
    write fails, and the failure is re-raised here. True when the source ended
    normally and every item was written.
    """
    box = Mailbox()
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_producer, source, box)
        tg.start_soon(_cancel_on_disconnect, request, tg.cancel_scope)
        try:
            await _write_items(box, write, sse, ping_interval)
        except Exception as exc:  # re-raised bare, not wrapped in an exception group
            failure = exc
        tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return box.closed and not box.failed and not request.is_disconnected()


async def _write_items(
    box: Mailbox, write: Callable[[bytes], Awaitable[None]], sse: bool, ping_interval: float
) -> None:
    while True:
        item = END
        with anyio.move_on_after(ping_interval) as idle:
            item = await box.get()
        if idle.cancelled_caught:
            await write(PING)  # a comment line: keeps proxies and clients from timing out
            continue
        if item is END:
            return
        data = frame_event(item) if sse else item
        if data:
            await write(data)


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    await request.disconnected.wait()
    scope.cancel()
