"""Socket streams for the asyncio backend that cost one event-loop pass per read.

anyio's asyncio socket stream re-arms the socket with epoll on every ``receive`` (it
pauses reading in between) and yields to the loop once more after every ``send``. On a
stream that carries a token per write, that is two extra system calls and one extra loop
pass per token. The stream here keeps reading up to a high-water mark (then pauses: the
peer still meets backpressure), hands over everything buffered in one ``receive``, and
returns from ``send`` without yielding. What one pass of the event loop writes goes out
in one system call at the end of the pass (up to ``FLUSH_BYTES``, then at once): a
response head, its last SSE event, ``[DONE]`` and the end of its chunked body usually
leave together. One callback per loop pass flushes every stream that wrote in it
(``at_pass_end``): when a worker's step wakes a thousand streams, their thousand writes
cost one loop callback, not one each. When the kernel did not take a flush whole, the next
``send`` waits until the write buffer is empty, as anyio's does (``try_send``, the same
without a coroutine, then writes nothing and says so).

``wrap_listener`` turns the listeners of ``anyio.create_tcp_listener`` /
``create_unix_listener`` into listeners of these streams. On any other backend (trio)
it returns the listener unchanged, so callers never branch.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import sys
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.abc import SocketAttribute
from anyio.streams.stapled import MultiListener

__all__ = [
    "AsyncioSocketListener",
    "AsyncioSocketStream",
    "at_pass_end",
    "kernel_unsent",
    "wrap_listener",
]

HIGH_WATER = 256 * 1024  # bytes read ahead of the consumer before reading pauses
FLUSH_BYTES = 64 * 1024  # writes held for the end of the loop pass, at most


class _Protocol(asyncio.Protocol):
    __slots__ = (
        "transport",
        "chunks",
        "size",
        "eof",
        "lost",
        "exc",
        "paused",
        "_read_waiter",
        "drained",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.eof = False
        self.lost = False
        self.exc: BaseException | None = None
        self.paused = False
        self._read_waiter: asyncio.Future[None] | None = None
        self.drained = asyncio.Event()  # clear while the transport holds unsent bytes
        self.drained.set()

    # -- asyncio callbacks --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(0)  # send() returns once the kernel has it all

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.size += len(data)
        if self.size > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake_reader()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake_reader()
        return True  # keep the write side open (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.exc = exc
        self._wake_reader()
        self.drained.set()

    def pause_writing(self) -> None:
        self.drained.clear()

    def resume_writing(self) -> None:
        self.drained.set()

    # -- for the stream -----------------------------------------------------------------
    def _wake_reader(self) -> None:
        w = self._read_waiter
        if w is not None:
            self._read_waiter = None
            if not w.done():
                w.set_result(None)

    async def wait_readable(self) -> None:
        assert self.transport is not None
        self._read_waiter = waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._read_waiter = None

    def take(self, max_bytes: int) -> bytes:
        chunks = self.chunks
        data = chunks.popleft()
        if chunks and len(data) < max_bytes:
            parts = [data]
            n = len(data)
            while chunks and n + len(chunks[0]) <= max_bytes:
                part = chunks.popleft()
                parts.append(part)
                n += len(part)
            data = b"".join(parts)
        if len(data) > max_bytes:
            chunks.appendleft(data[max_bytes:])
            data = data[:max_bytes]
        self.size -= len(data)
        if self.paused and self.size <= HIGH_WATER // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data


log = logging.getLogger("transport")

# SIOCOUTQ (= TIOCOUTQ): the bytes in a TCP socket's send queue that the peer has not
# acknowledged (tcp(7)); Linux only. A peer's kernel acknowledges only what its receive
# buffer has room for, so this shrinks exactly as fast as the client reads.
_SIOCOUTQ = 0x5411 if sys.platform.startswith("linux") else None


def kernel_unsent(sock: socket.socket) -> int:
    """Bytes of ``sock``'s send queue its peer has not taken yet; 0 where the kernel
    cannot say (not Linux, not TCP, closed)."""
    if _SIOCOUTQ is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return 0
    try:
        out = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", out)[0])


class _PassEnd:
    """What runs once at the end of this pass of one event loop: the functions added
    during the pass, in the order added, from one loop callback."""

    __slots__ = ("_loop", "_fns")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fns: list[Callable[[], None]] = []

    def add(self, fn: Callable[[], None]) -> None:
        if not self._fns:
            self._loop.call_soon(self._run)
        self._fns.append(fn)

    def _run(self) -> None:
        fns, self._fns = self._fns, []
        for fn in fns:
            try:
                fn()
            except Exception:  # one failure must not keep the others from running
                log.exception("an end-of-pass function failed")


_PASS_ENDS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _PassEnd] = (
    weakref.WeakKeyDictionary()
)


def _pass_end() -> _PassEnd:
    loop = asyncio.get_running_loop()
    p = _PASS_ENDS.get(loop)
    if p is None:
        p = _PASS_ENDS[loop] = _PassEnd(loop)
    return p


def at_pass_end() -> Callable[[Callable[[], None]], None]:
    """The running loop's end-of-pass queue: ``add(fn)`` runs ``fn`` once, with
    everything else added in this pass, from one callback at the pass's end. The
    streams' flushes go through it, and so may a stream's producer (a chunk pushed
    from the pass that brought it, ``lifecycle/api/native.py``)."""
    return _pass_end().add


class AsyncioSocketStream(anyio.abc.SocketStream):
    """An anyio socket stream over an asyncio transport (see the module's text)."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol) -> None:
        self._transport = transport
        self._protocol = protocol
        self._closed = False
        self._eof_sent = False
        self._pending: list[bytes] = []  # written in this loop pass, flushed at its end
        self._pending_size = 0
        self._at_pass_end: Callable[[Callable[[], None]], None] | None = None  # from 1st send
        self._flush_fn = self._flush  # one bound method, not one a send

    @classmethod
    async def adopt(cls, sock: socket.socket) -> AsyncioSocketStream:
        """Take over a connected socket (TCP or UNIX)."""
        loop = asyncio.get_running_loop()
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport, protocol = await loop.connect_accepted_socket(_Protocol, sock)
        return cls(transport, protocol)

    @property
    def _raw_socket(self) -> socket.socket:
        return self._transport.get_extra_info("socket")  # type: ignore[no-any-return]

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be a positive integer")
        p = self._protocol
        if not p.chunks:
            self._check_readable()
            await p.wait_readable()
            if not p.chunks:
                self._check_readable()
                raise anyio.EndOfStream  # woken with nothing: the connection ended
        return p.take(max_bytes)

    def read_ahead(self) -> int:
        """How many received bytes wait here for ``receive``: the peer sent them, and
        the server has them, whether or not anyone is reading yet."""
        return self._protocol.size

    def _check_readable(self) -> None:
        p = self._protocol
        if self._closed:
            raise anyio.ClosedResourceError
        if p.exc is not None:
            raise anyio.BrokenResourceError from p.exc
        if p.eof or p.lost:
            raise anyio.EndOfStream

    def unsent(self) -> int:
        """Bytes written that the peer has not taken yet: held for this pass's flush, in
        the transport's buffer, and in the kernel's send queue. It shrinks while the
        client reads, however slowly, and stands still when it stops (the send deadline,
        ``Channel.send_stalled``)."""
        held = self._pending_size + self._transport.get_write_buffer_size()
        sock = self._transport.get_extra_info("socket")
        return held + (kernel_unsent(sock) if sock is not None else 0)

    def can_send_now(self) -> bool:
        """Whether ``try_send`` would take an item now (open, not lost, drained)."""
        p = self._protocol
        if self._closed or self._eof_sent or p.lost or self._transport.is_closing():
            return False
        return p.drained.is_set()

    def try_send(self, item: bytes) -> bool:
        """``send`` without the coroutine, when it would not wait: False (and nothing
        written) while the transport still holds bytes the kernel has not taken, and
        then ``send`` is the way. Raises as ``send`` does on a closed or lost stream."""
        self._check_writable()
        if not self._protocol.drained.is_set():
            return False
        self._hold(item)
        return True

    async def send(self, item: bytes) -> None:
        p = self._protocol
        self._check_writable()
        self._hold(item)
        if not p.drained.is_set():
            await p.drained.wait()
            if self._closed:
                raise anyio.ClosedResourceError
            if p.lost:
                raise anyio.BrokenResourceError from p.exc

    def _check_writable(self) -> None:
        p = self._protocol
        if self._closed or self._eof_sent:
            raise anyio.ClosedResourceError
        if p.lost or self._transport.is_closing():
            raise anyio.BrokenResourceError from p.exc

    def _hold(self, item: bytes) -> None:
        """Keep ``item`` for the flush at the end of this loop pass (at once past
        ``FLUSH_BYTES``)."""
        if not self._pending:
            (self._at_pass_end or self._bind())(self._flush_fn)
        self._pending.append(item)
        self._pending_size += len(item)
        if self._pending_size >= FLUSH_BYTES:
            self._flush()

    def _bind(self) -> Callable[[Callable[[], None]], None]:
        self._at_pass_end = at_pass_end()
        return self._at_pass_end

    def _flush(self) -> None:
        """Hand what this loop pass wrote to the transport: one system call for all of it."""
        if not self._pending:
            return
        data = b"".join(self._pending)  # one bytes item: itself, no copy
        self._pending.clear()
        self._pending_size = 0
        if not self._transport.is_closing():
            self._transport.write(data)

    async def send_eof(self) -> None:
        self._flush()
        self._eof_sent = True
        try:
            self._transport.write_eof()
        except OSError:
            pass

    async def aclose(self) -> None:
        self._flush()  # what the kernel takes now still goes out, as if written at once
        self._closed = True
        self._transport.abort()  # connection_lost follows and wakes any waiter
        await anyio.lowlevel.checkpoint()


class AsyncioSocketListener(anyio.abc.SocketListener):
    """Accepts on the listening socket of an anyio listener, yielding our streams."""

    def __init__(self, inner: anyio.abc.SocketListener) -> None:
        self._inner = inner
        self._sock: socket.socket = inner.extra(SocketAttribute.raw_socket)
        self._accept_scope: anyio.CancelScope | None = None
        self._closed = False

    @property
    def _raw_socket(self) -> socket.socket:
        return self._sock

    async def accept(self) -> AsyncioSocketStream:
        if self._closed:
            raise anyio.ClosedResourceError
        loop = asyncio.get_running_loop()
        client = None
        with anyio.CancelScope() as self._accept_scope:
            try:
                client, _addr = await loop.sock_accept(self._sock)
            except asyncio.CancelledError:
                _remove_reader(loop, self._sock)  # https://bugs.python.org/issue41317
                raise
            finally:
                self._accept_scope = None
        if client is None:  # aclose() cancelled the accept
            raise anyio.ClosedResourceError
        return await AsyncioSocketStream.adopt(client)

    async def aclose(self) -> None:
        self._closed = True
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        await self._inner.aclose()


def _remove_reader(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    try:
        loop.remove_reader(sock)
    except (ValueError, NotImplementedError):
        pass


def wrap_listener(listener: anyio.abc.Listener[Any]) -> anyio.abc.Listener[Any]:
    """Our streams for what ``listener`` accepts, on asyncio; elsewhere ``listener`` itself."""
    if not _on_asyncio():
        return listener
    if isinstance(listener, MultiListener):
        return MultiListener([wrap_listener(sub) for sub in listener.listeners])
    if isinstance(listener, anyio.abc.SocketListener):
        return AsyncioSocketListener(listener)
    return listener


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio, or no loop at all
        return False
    return True
