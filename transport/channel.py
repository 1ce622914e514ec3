"""What the two halves of an HTTP/1.1 connection share: the socket and its protocol state.

The reading half (``reader``) and the writing half (``respond``) each hold their
connection's one ``Channel`` and never each other, so neither module imports the other;
``http11`` builds all three and drives them.

Bytes wait in ``buf`` for the fast path (``fastpath``) while h11 is idle and has seen
nothing. Once a request needs h11, every byte held goes to it (``go_live``) and h11 keeps
the connection's state until it is idle and empty again. ``raw`` keeps the bytes of the
current fast request, so that h11 can still answer it (``replay``).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio
import anyio.abc
import h11

from .aio import kernel_unsent
from .config import ServerConfig
from .request import Request
from .responses import Response

__all__ = ["STREAM_ERRORS", "App", "Channel", "ClientGone", "ServerState"]

App = Callable[[Request], Awaitable[Response]]
STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


_LINGER_ZERO = struct.pack("ii", 1, 0)  # struct linger {l_onoff = 1, l_linger = 0}


def _unsent_probe(stream: anyio.abc.ByteStream) -> Callable[[], int] | None:
    """How to ask ``stream`` (or the socket stream under its TLS) how many written bytes
    its peer has not taken; None where nothing can say."""
    base = getattr(stream, "transport_stream", stream)
    unsent: Callable[[], int] | None = getattr(base, "unsent", None)
    if unsent is not None:
        return unsent
    try:
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    except anyio.TypedAttributeLookupError:
        return None
    return lambda: kernel_unsent(sock)  # another backend's stream: the kernel's count


class ServerState(Protocol):
    draining: bool
    retry_after: int  # seconds, on the server's own 503s while draining


class ClientGone(Exception):
    """A write failed or stalled; the connection is finished."""


class Channel:
    """One connection's socket, h11 state and fast-path buffer, and the request in flight."""

    def __init__(
        self,
        stream: anyio.abc.ByteStream,
        config: ServerConfig,
        client: tuple[str, int] | None,
        server: ServerState,
    ) -> None:
        self.stream = stream
        self.config = config
        self.client = client
        self.server = server
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=config.max_header_bytes)
        self.current: Request | None = None
        self.buf = b""  # bytes for the fast path, while h11 is not live
        self.live = False  # h11 holds the connection's state: every byte goes to it
        self.raw = b""  # the current fast request's bytes: h11 replays them if needed
        self.close_after = False  # the current fast request asked for Connection: close
        self.graceful = True  # close with FIN and linger, not a reset
        # When the write in progress began, or last made progress (``send_stalled``), and
        # how many bytes the peer had not taken then (-1: not looked at yet).
        self.send_since: float | None = None
        self.send_left = -1
        # The stream's write that needs no coroutine, when it has one (``try_write``).
        self._try_send: Callable[[bytes], bool] | None = getattr(stream, "try_send", None)
        self._can_send: Callable[[], bool] | None = getattr(stream, "can_send_now", None)
        # Bytes the stream read ahead of us (``AsyncioSocketStream.read_ahead``), if it can say.
        self._read_ahead: Callable[[], int] | None = getattr(stream, "read_ahead", None)
        self._unsent = _unsent_probe(stream)

    def go_live(self) -> None:
        """Hand every byte held so far to h11, which keeps the connection's state from here."""
        self.live = True
        data, self.raw, self.buf = self.raw + self.buf, b"", b""
        if data:
            self.h11.receive_data(data)

    def replay(self) -> None:
        """Let h11 catch up on the current fast request, to answer it through h11."""
        replaying = bool(self.raw)
        self.go_live()
        for _ in range(4) if replaying else ():  # Request, Data, EndOfMessage
            if type(self.h11.next_event()) is h11.EndOfMessage:
                return
        if replaying:
            raise RuntimeError("h11 did not parse a request the fast path accepted")

    def held(self) -> int:
        """How many received bytes wait for a later request."""
        return len(self.h11.trailing_data[0]) if self.live else len(self.buf)

    def has_pending(self) -> bool:
        """Whether bytes of a next request have arrived: in h11, the fast-path buffer, or
        the stream's own read-ahead (a pipelined request nobody has asked for yet, which a
        drain must still answer rather than close on)."""
        if self.buf or self.h11.trailing_data[0]:
            return True
        read_ahead = self._read_ahead
        return read_ahead is not None and read_ahead() > 0

    def can_write_now(self) -> bool:
        """Whether ``try_write`` would write at once now."""
        can_send = self._can_send
        return can_send is not None and self._try_send is not None and can_send()

    def try_write(self, request: Request, data: bytes) -> bool:
        """Write ``data`` at once when the stream takes it without waiting (True); False,
        with nothing written, when only ``write`` can (a stream without ``try_send``, or
        a client still reading the last write)."""
        try_send = self._try_send
        if try_send is None:
            return False
        try:
            return try_send(data)
        except STREAM_ERRORS:
            request.mark_disconnected("client_gone")
            raise ClientGone from None

    def send_stalled(self, now: float) -> bool:
        """Whether the write in progress has made no progress for ``send_timeout``: the
        watchdog's question, a few times per period. Progress is the peer taking bytes
        (``unsent`` shrinking), not the write ending: a client reading a large frame at
        a steady 4 KB/s is slow, not stalled, however long that one write takes. Where
        the stream cannot say what it has not sent, the write's own length counts."""
        since = self.send_since
        if since is None:
            return False
        unsent = self._unsent
        if unsent is not None:
            left = unsent()
            if 0 <= left < self.send_left:  # the peer took bytes since the last look
                self.send_since = since = now
            self.send_left = left
        return now - since >= self.config.send_timeout

    def abort_on_close(self) -> None:
        """Make the close a reset (SO_LINGER 0, RFC 9293 section 3.10.7.1's ABORT): what
        the kernel still holds for the peer is dropped, so a client cut off mid-stream
        sees its read fail instead of a trickle of old bytes and an end that looks like
        a slow stream's."""
        self.graceful = False
        try:
            sock = self.stream.extra(anyio.abc.SocketAttribute.raw_socket)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
        except (anyio.TypedAttributeLookupError, OSError):
            pass  # not a socket (a test's memory stream), or already closed

    async def write(self, request: Request, data: bytes) -> None:
        # A write that makes no progress for send_timeout cancels the whole connection
        # (send_stalled, check_deadlines).
        self.send_since = time.monotonic()
        self.send_left = -1
        try:
            await self.stream.send(data)
        except STREAM_ERRORS:
            request.mark_disconnected("client_gone")
            raise ClientGone from None
        finally:
            self.send_since = None
