"""What a call's owner sleeps on between chunks (``lifecycle.core.call``)."""

from __future__ import annotations

import asyncio

__all__ = ["Wakeup"]


class Wakeup:
    """What the call's owner sleeps on between chunks: the worker link sets it for each
    chunk of the call, the owner's ``wait`` clears it. One waiter, reset in place: a bare
    asyncio future per sleep, where a fresh ``anyio.Event`` a chunk (its asyncio event,
    its future, its waiter list) was a sixth of the frontend's CPU per streamed token
    (``bench/frontend_paced.py``). The request core runs on asyncio, as the transport does
    (``transport/aio.py``)."""

    __slots__ = ("_is_set", "_waiter")

    def __init__(self) -> None:
        self._is_set = False
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._is_set = True
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    @property
    def parked(self) -> bool:
        """Whether the owner sleeps in ``wait`` and nothing has woken it yet."""
        waiter = self._waiter
        return waiter is not None and not waiter.done() and not self._is_set

    def take(self) -> bool:
        """Whether it was set since the last ``wait`` or ``take``; cleared."""
        was, self._is_set = self._is_set, False
        return was

    async def wait(self) -> None:
        """Until set (at once if it is); cleared on return. Cancellable."""
        if not self._is_set:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        self._is_set = False
