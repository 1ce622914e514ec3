"""Frames over a socket: the thin driver around the sans-IO ``wire`` codec.

Addresses are ``unix:/path/to/sock`` or ``tcp:HOST:PORT`` (a bare ``HOST:PORT`` is read
as TCP), the same spelling the worker's ``--listen`` takes.

``FrameStream`` runs over any anyio byte stream. ``connect`` on the asyncio backend
skips the byte stream: an asyncio protocol cuts frames out of the bytes as they arrive
and keeps the socket armed, so a frame costs no epoll re-arm and no extra loop pass
(anyio's stream pauses reading between receives). Reading pauses once ``_MAX_READY``
frames wait unread, so a worker that outruns the frontend still meets backpressure.
"""

from __future__ import annotations

import asyncio
import math
import ssl
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel

from wire import Frame, FrameBuffer, decode_frame, encode_frame, frame_bytes
from wire.address import Address, listen_unix, parse_address
from wire.faults import Fault, fault_point

__all__ = [
    "Address",
    "FrameStream",
    "client_tls_context",
    "connect",
    "listen",
    "parse_address",
    "serve",
]

_READ_SIZE = 1 << 20
_MAX_READY = 4096  # frames received and not yet taken before reading pauses


def _asyncio_loop() -> asyncio.AbstractEventLoop | None:
    """The running asyncio loop; None on another backend (trio: the byte-stream path)."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def client_tls_context(cafile: str | None = None) -> ssl.SSLContext:
    """What a ``tls:`` address is verified with: ``cafile``'s CAs, else the system's;
    the worker's certificate must name the address's host."""
    ctx = ssl.create_default_context(cafile=cafile)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    return ctx


async def connect(address: Address, tls: ssl.SSLContext | None = None) -> FrameStream:
    """A frame stream to ``address``; a ``tls:`` address runs inside TLS with ``tls``
    (default: ``client_tls_context()``)."""
    if address.tls and tls is None:
        tls = client_tls_context()
    ssl_ctx = tls if address.tls else None
    loop = _asyncio_loop()
    if loop is not None:
        if address.kind == "unix":
            _, conn = await loop.create_unix_connection(_FrameConnection, address.path)
        else:
            _, conn = await loop.create_connection(
                _FrameConnection,
                address.host,
                address.port,
                ssl=ssl_ctx,
                server_hostname=address.host if ssl_ctx else None,
            )
        return FrameStream(conn)
    if address.kind == "unix":
        stream: anyio.abc.ByteStream = await anyio.connect_unix(address.path)
    elif ssl_ctx is not None:
        stream = await anyio.connect_tcp(
            address.host, address.port, ssl_context=ssl_ctx, tls_hostname=address.host
        )
    else:
        stream = await anyio.connect_tcp(address.host, address.port)
    return FrameStream(stream)


async def listen(address: Address) -> anyio.abc.Listener[anyio.abc.ByteStream]:
    if address.kind == "unix":
        return await anyio.abc.SocketListener.from_socket(listen_unix(address.path))
    return await anyio.create_tcp_listener(local_host=address.host, local_port=address.port)


async def serve(
    address: Address,
    handler: Callable[[FrameStream], Coroutine[Any, Any, None]],
    side: str = "worker",
) -> None:
    """Accept connections at ``address`` until cancelled; ``handler`` gets each one as a
    ``FrameStream``, in a task of its own."""
    loop = _asyncio_loop()
    if loop is None:  # through an anyio listener
        listener = await listen(address)

        async def on_stream(stream: anyio.abc.ByteStream) -> None:
            await handler(FrameStream(stream, side=side))

        await listener.serve(on_stream)
        return
    accepted, arrivals = anyio.create_memory_object_stream[_FrameConnection](math.inf)

    def factory() -> _FrameConnection:
        return _FrameConnection(on_made=accepted.send_nowait)

    if address.kind == "unix":
        server = await loop.create_unix_server(factory, sock=listen_unix(address.path))
    else:
        server = await loop.create_server(factory, address.host, address.port)
    try:
        async with anyio.create_task_group() as tg, arrivals:
            async for conn in arrivals:
                tg.start_soon(handler, FrameStream(conn, side=side))
    finally:
        server.close()
        accepted.close()


class _FrameConnection(asyncio.Protocol):
    """One socket on asyncio: complete frame payloads in, encoded frames out."""

    def __init__(self, on_made: Callable[[_FrameConnection], object] | None = None) -> None:
        self._on_made = on_made
        self.transport: asyncio.Transport | None = None
        self.buf = FrameBuffer()
        self.ready: deque[bytes] = deque()
        self.ended = False  # EOF or connection lost: no more frames will come
        self.error: ValueError | None = None  # an impossible frame length
        self.paused = False
        self._reader: asyncio.Future[None] | None = None
        self._drained = asyncio.Event()
        self._drained.set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(0)  # a send returns once the kernel has it all
        if self._on_made is not None:
            self._on_made(self)

    def data_received(self, data: bytes) -> None:
        try:
            self.ready.extend(self.buf.feed(data))
        except ValueError as exc:
            self.error = exc
        if (len(self.ready) > _MAX_READY or self.error) and not self.paused:
            self.paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake()
        return False  # close the transport: a worker connection is never half-open

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self._wake()
        self._drained.set()

    def pause_writing(self) -> None:
        self._drained.clear()

    def resume_writing(self) -> None:
        self._drained.set()

    def _wake(self) -> None:
        w = self._reader
        if w is not None:
            self._reader = None
            if not w.done():
                w.set_result(None)

    async def next_payload(self) -> bytes:
        """The next frame's payload; ``EndOfStream`` once the connection ended."""
        while not self.ready:
            if self.error is not None:
                raise self.error
            if self.ended:
                raise anyio.EndOfStream
            self._reader = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._reader = None
        payload = self.ready.popleft()
        if self.paused and not self.error and len(self.ready) <= _MAX_READY // 2:
            self.paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return payload

    async def send(self, data: bytes) -> None:
        t = self.transport
        if t is None or self.ended or t.is_closing():
            raise anyio.BrokenResourceError("the connection is closed")
        t.write(data)
        if not self._drained.is_set():
            await self._drained.wait()
            if self.ended:
                raise anyio.BrokenResourceError("the connection closed")

    def abort(self) -> None:
        self.ended = True
        if self.transport is not None:
            self.transport.abort()
        self._wake()


class FrameStream:
    """Whole frames in and out. Sends are serialised by a lock (several tasks write)."""

    __slots__ = ("_stream", "_conn", "_buf", "_ready", "_lock", "_send_point", "_recv_point")

    def __init__(
        self, stream: anyio.abc.ByteStream | _FrameConnection, side: str = "frontend"
    ) -> None:
        self._stream: anyio.abc.ByteStream | None = None
        self._conn: _FrameConnection | None = None
        if isinstance(stream, _FrameConnection):
            self._conn = stream
        else:
            self._stream = stream
        self._buf = FrameBuffer()
        self._ready: list[bytes] = []
        self._lock = anyio.Lock()
        # Fault points (``wire.faults``): "frontend.frame_send", "worker.frame_recv", ...
        self._send_point = f"{side}.frame_send"
        self._recv_point = f"{side}.frame_recv"

    async def send(self, frame: Frame) -> None:
        await self.send_many([frame])

    async def send_many(self, frames: list[Frame]) -> None:
        """Frames in order, in one write call (never interleaved with another task's);
        the send fault point applies to each frame."""
        parts = []
        for frame in frames:
            data = frame_bytes(encode_frame(frame))
            if (f := fault_point(self._send_point)) is not None:
                data = await self._inject(await f.apply_async(), data)
            parts.append(data)
        data = b"".join(parts)
        if self._conn is not None:
            await self._conn.send(data)
            return
        assert self._stream is not None
        async with self._lock:
            await self._stream.send(data)

    async def _inject(self, fault: Fault | None, data: bytes) -> bytes:
        if fault is None:
            return data
        if fault.action == "drop":
            await self.aclose()
            raise anyio.BrokenResourceError(fault.message)
        return _corrupt(data, head=4)

    async def receive(self) -> Frame:
        """The next frame; ``anyio.EndOfStream`` when the peer closed.

        Raises ``WireError``/``ValueError`` for a corrupt frame (the caller closes)."""
        if self._conn is not None:
            payload = await self._conn.next_payload()
        else:
            payload = await self._next_from_stream()
        if (f := fault_point(self._recv_point)) is not None:
            f = await f.apply_async()
            if f is not None and f.action == "drop":
                await self.aclose()
                raise anyio.EndOfStream
            if f is not None:
                payload = _corrupt(payload, head=0)
        return decode_frame(payload)

    async def _next_from_stream(self) -> bytes:
        assert self._stream is not None
        while not self._ready:
            try:
                data = await self._stream.receive(_READ_SIZE)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                raise anyio.EndOfStream from None
            self._ready = self._buf.feed(data)
            self._ready.reverse()
        return self._ready.pop()

    async def aclose(self) -> None:
        if self._conn is not None:
            self._conn.abort()
            await anyio.lowlevel.checkpoint()
            return
        assert self._stream is not None
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()


def _corrupt(data: bytes, head: int) -> bytes:
    """Keep the length prefix, garble the CBOR: the peer must refuse the frame, not crash."""
    return data[:head] + b"\xff" * (len(data) - head)
