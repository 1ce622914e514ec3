"""The Engine's event loop: one daemon thread running anyio with a ``BlockingPortal``,
and the two bridges callers cross it by: blocking calls from plain threads, and awaits
from the caller's own asyncio loop, whose cancellation cancels the task in the Engine's
loop (so the call's scope ends the request with the caller-left cause)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import Future
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from anyio.from_thread import BlockingPortal

__all__ = ["EngineLoop"]

T = TypeVar("T")
_CHUNKS_IN_FLIGHT = 16  # a stream's bounded handoff between the two loops


class EngineLoop:
    """``stopped``: the error a call into the loop raises once it has stopped (or while
    it stops), instead of the portal's own."""

    def __init__(self, stopped: Callable[[], BaseException] = lambda: RuntimeError("stopped")):
        self._stopped_error = stopped
        self.stopped = False
        box: dict[str, Any] = {}
        ready = threading.Event()

        def main() -> None:
            async def run() -> None:
                async with BlockingPortal() as portal:
                    box["portal"] = portal
                    ready.set()
                    await portal.sleep_until_stopped()

            try:
                anyio.run(run)
            finally:
                ready.set()

        # A daemon: a caller that never shuts the Engine down does not hang the exit
        # (atexit shuts it down; the worker also exits when its parent does).
        self._thread = threading.Thread(target=main, name="lifecycle-engine", daemon=True)
        self._thread.start()
        ready.wait()
        self.portal: BlockingPortal = box["portal"]

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run ``fn(*args)`` in the loop and block for its result."""
        if self.stopped:
            raise self._stopped_error()
        try:
            return self.portal.call(fn, *args)
        except RuntimeError:
            if self.stopped or not self._thread.is_alive():  # the portal stopped under us
                raise self._stopped_error() from None
            raise

    def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> tuple[Future[Any], Any]:
        """``fn(*args, task_status=...)`` as a task; blocks until it says started."""
        return self.portal.start_task(fn, *args)

    async def bridge(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Await ``fn(*args)`` in the loop from the caller's asyncio loop; cancelling the
        awaiting task cancels it there."""
        if self.stopped:
            raise self._stopped_error()
        fut = self.portal.start_task_soon(fn, *args)
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            fut.cancel()
            raise

    def iterate(
        self,
        agen: Callable[[], AsyncGenerator[T, None]],
        stall_after: float | None = None,
        stalled: Callable[[], BaseException] | None = None,
    ) -> Iterator[T]:
        """A blocking iterator over ``agen()`` run in the loop; closing it (``break``)
        cancels the producer. A consumer that takes nothing for ``stall_after`` seconds
        while the handoff is full (it left, keeping the iterator) ends the producer with
        ``stalled()``, which the consumer then gets after the chunks already handed."""
        send, receive = anyio.create_memory_object_stream[T](_CHUNKS_IN_FLIGHT)
        fut = self.portal.start_task_soon(_produce, agen, send, stall_after, stalled)
        try:
            while True:
                try:
                    item = self.call(receive.receive)
                except anyio.EndOfStream:
                    break
                yield item
            fut.result()  # the producer's error, if it ended with one
        finally:
            fut.cancel()
            if self.stopped:
                receive.close()  # the loop is gone: nobody else touches the stream
            else:
                self.call(receive.aclose)

    async def aiterate(
        self,
        agen: Callable[[], AsyncGenerator[T, None]],
        stall_after: float | None = None,
        stalled: Callable[[], BaseException] | None = None,
    ) -> AsyncIterator[T]:
        """``iterate`` for an asyncio caller."""
        if self.stopped:
            raise self._stopped_error()
        send, receive = anyio.create_memory_object_stream[T](_CHUNKS_IN_FLIGHT)
        fut = self.portal.start_task_soon(_produce, agen, send, stall_after, stalled)
        try:
            while True:
                try:
                    item = await self.bridge(receive.receive)
                except anyio.EndOfStream:
                    break
                yield item
            await asyncio.wrap_future(fut)
        finally:
            fut.cancel()
            if self.stopped:
                receive.close()
            else:
                self.portal.start_task_soon(receive.aclose)

    def stop(self) -> None:
        self.stopped = True
        if self._thread.is_alive():
            try:
                self.portal.call(self.portal.stop, True)
            except RuntimeError:  # already stopped
                pass
            self._thread.join(timeout=30)


async def _produce(
    agen: Callable[[], AsyncGenerator[T, None]],
    send: Any,
    stall_after: float | None,
    stalled: Callable[[], BaseException] | None,
) -> None:
    # ``aclosing``: whatever ends this task (the consumer closed, a stall, cancellation)
    # closes the generator here and now, so its call's scope ends the request at once,
    # never when the garbage collector gets to it.
    async with send, aclosing(agen()) as gen:
        async for item in gen:
            with anyio.move_on_after(stall_after if stalled is not None else None) as scope:
                await send.send(item)
            if scope.cancelled_caught:
                assert stalled is not None
                raise stalled()
