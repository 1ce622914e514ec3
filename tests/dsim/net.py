"""In-memory connections: byte pipes with half-close, reset and a bounded buffer, and a
listener that hands their server ends to ``transport.Server``.

A pipe behaves as a TCP connection does to the code on each end: ``send_eof`` is a FIN
(the peer reads what was sent, then end of stream), ``aclose`` closes both directions
(the peer's later sends fail), ``reset`` is an RST (the peer's reads and sends fail at
once, unread bytes are lost). ``capacity`` bounds the bytes in flight in one direction,
like a socket buffer: a writer to a reader that stopped reading waits, which is what the
transport's send timeout is for.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["PipeEnd", "SimListener", "pipe"]


class _Direction:
    """Bytes one way: what the writer sent and the reader has not taken."""

    __slots__ = ("buf", "eof", "reset", "reader_gone", "capacity", "_waiters")

    def __init__(self, capacity: int) -> None:
        self.buf = bytearray()
        self.eof = False  # the writer half-closed or closed
        self.reset = False  # RST: reads fail, unread bytes are gone
        self.reader_gone = False  # the reader closed: sends fail
        self.capacity = capacity
        self._waiters: list[anyio.Event] = []

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            w.set()

    async def wait(self) -> None:
        event = anyio.Event()
        self._waiters.append(event)
        await event.wait()


class PipeEnd(anyio.abc.ByteStream):
    """One end of an in-memory connection (an anyio byte stream)."""

    def __init__(self, rx: _Direction, tx: _Direction, name: str) -> None:
        self._rx, self._tx = rx, tx
        self.name = name
        self.closed = False
        self.on_send: Callable[[bytes], list[bytes]] | None = None  # link faults (frames)

    async def receive(self, max_bytes: int = 65536) -> bytes:
        rx = self._rx
        while True:
            if self.closed:
                raise anyio.ClosedResourceError
            if rx.reset:
                raise anyio.BrokenResourceError("connection reset by peer")
            if rx.buf:
                data = bytes(rx.buf[:max_bytes])
                del rx.buf[:max_bytes]
                rx.wake()  # a writer waiting for room
                return data  # no yield, as transport.aio's stream: one loop pass per read
            if rx.eof:
                raise anyio.EndOfStream
            await rx.wait()

    async def send(self, item: bytes) -> None:
        tx = self._tx
        self._check_send()
        parts = self.on_send(item) if self.on_send is not None else [item]
        for part in parts:
            tx.buf += part
        tx.wake()  # no yield while there is room, as transport.aio's stream
        while len(tx.buf) > tx.capacity:
            self._check_send()
            await tx.wait()

    def _check_send(self) -> None:
        tx = self._tx
        if self.closed or tx.eof:
            raise anyio.ClosedResourceError
        if tx.reader_gone or tx.reset or self._rx.reset:
            raise anyio.BrokenResourceError("connection closed by peer")

    async def send_eof(self) -> None:
        self._tx.eof = True
        self._tx.wake()

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self._tx.eof = True
            self._rx.reader_gone = True
            self._tx.wake()
            self._rx.wake()
        await anyio.lowlevel.checkpoint()

    def reset(self) -> None:
        """RST: both directions fail for the peer at once."""
        self.closed = True
        for d in (self._tx, self._rx):
            d.reset = True
            d.wake()

    def unread(self) -> int:
        return len(self._rx.buf)

    @property
    def extra_attributes(self) -> Any:
        return {}


def pipe(
    name: str, capacity_in: int = 1 << 20, capacity_out: int = 1 << 20
) -> tuple[PipeEnd, PipeEnd]:
    """(client end, server end); ``capacity_out`` bounds what the server end may have
    unread by the client (a slow reader's socket buffer)."""
    c2s, s2c = _Direction(capacity_in), _Direction(capacity_out)
    return PipeEnd(s2c, c2s, f"{name}/client"), PipeEnd(c2s, s2c, f"{name}/server")


class SimListener(anyio.abc.Listener[PipeEnd]):
    """Accepts what ``connect`` sends it; closing it refuses the connections that follow."""

    def __init__(self) -> None:
        send: MemoryObjectSendStream[PipeEnd]
        recv: MemoryObjectReceiveStream[PipeEnd]
        send, recv = anyio.create_memory_object_stream[PipeEnd](math.inf)
        self._send, self._recv = send, recv
        self.closed = False
        self.serving: dict[Any, PipeEnd] = {}  # connection task -> its server end

    def connect(self, end: PipeEnd) -> bool:
        if self.closed:
            return False
        self._send.send_nowait(end)
        return True

    async def serve(self, handler: Any, task_group: anyio.abc.TaskGroup | None = None) -> None:
        assert task_group is not None
        async for end in self._recv:
            task_group.start_soon(self._serve_one, handler, end)

    async def _serve_one(self, handler: Any, end: PipeEnd) -> None:
        task = asyncio.current_task()
        self.serving[task] = end  # which connection a handler runs for (``World``)
        try:
            await handler(end)
        finally:
            del self.serving[task]

    async def aclose(self) -> None:
        self.closed = True
        self._send.close()
        while True:  # what waited in the backlog is reset, as a closing TCP listener does
            try:
                self._recv.receive_nowait().reset()
            except (anyio.WouldBlock, anyio.EndOfStream):
                break
        self._recv.close()
        await anyio.lowlevel.checkpoint()

    @property
    def extra_attributes(self) -> Any:
        return {}
