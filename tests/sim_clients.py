"""Clients for the simulation (``tests/simulation.py``): raw sockets that can leave at any
byte, with FIN or RST, read slowly or not at all.

``RawConn`` is a non-blocking socket driven by ``anyio.wait_readable``/``wait_writable``
(no stream wrapper, so socket options such as ``SO_RCVBUF`` are set before ``connect``
and ``SO_LINGER 0`` makes ``close`` send RST). ``HttpExchange`` speaks HTTP/1.1 through
h11 as a client; ``WsClient`` speaks RFC 6455 through wsproto.
"""

from __future__ import annotations

import errno
import json
import socket
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import h11
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Message,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)

__all__ = ["Cut", "HttpExchange", "RawConn", "SseEvents", "WsClient"]

READ_SIZE = 65536


class Cut(Exception):
    """The server closed or reset the connection before the message was complete."""


class RawConn:
    """One TCP connection to the server; ``close(rst=True)`` resets it (SO_LINGER 0)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = False

    @classmethod
    async def connect(cls, port: int, *, rcvbuf: int | None = None) -> RawConn:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:  # before connect: the window is negotiated in the handshake
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        err = sock.connect_ex(("127.0.0.1", port))
        if err in (errno.EINPROGRESS, errno.EAGAIN):
            await anyio.wait_writable(sock)
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            sock.close()
            raise ConnectionError(errno.errorcode.get(err, str(err)))
        return cls(sock)

    async def send_all(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                sent = self.sock.send(view)
            except BlockingIOError:
                await anyio.wait_writable(self.sock)
                continue
            except OSError as exc:
                raise Cut(f"send failed: {exc}") from None
            view = view[sent:]

    async def recv(self) -> bytes:
        """Some bytes, or b"" at EOF; raises Cut on a reset."""
        while True:
            try:
                return self.sock.recv(READ_SIZE)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
            except OSError as exc:
                raise Cut(f"recv failed: {exc}") from None

    def close(self, *, rst: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        if rst:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


def request_head(method: str, path: str, length: int, *, keep_alive: bool) -> bytes:
    """A request head by hand: lets a client declare more body than it will send."""
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if not keep_alive:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@dataclass
class SseEvents:
    """``data:`` payloads of a ``text/event-stream`` body, parsed as they arrive."""

    events: list[Any] = field(default_factory=list)
    done: bool = False  # saw ``data: [DONE]``
    _buf: bytes = b""

    def feed(self, data: bytes) -> int:
        """Add body bytes; returns how many new events completed."""
        self._buf += data
        before = len(self.events)
        while b"\n\n" in self._buf:
            block, self._buf = self._buf.split(b"\n\n", 1)
            for line in block.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    self.done = True
                else:
                    self.events.append(json.loads(payload))
        return len(self.events) - before


class HttpExchange:
    """One request and its response on a ``RawConn``, parsed by h11 (client role)."""

    def __init__(self, conn: RawConn) -> None:
        self.conn = conn
        self.h11 = h11.Connection(h11.CLIENT)
        self.status: int | None = None
        self.headers: dict[str, str] = {}
        self.body_bytes = 0

    async def send(self, method: str, path: str, body: bytes, *, keep_alive: bool) -> None:
        headers = [
            ("Host", "127.0.0.1"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
        ]
        if not keep_alive:
            headers.append(("Connection", "close"))
        data = self.h11.send(h11.Request(method=method, target=path, headers=headers))
        data += self.h11.send(h11.Data(data=body)) + self.h11.send(h11.EndOfMessage())
        await self.conn.send_all(data)

    async def _event(self) -> Any:
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                raise Cut(f"incomplete response: {exc}") from None
            if event is not h11.NEED_DATA:
                return event
            self.h11.receive_data(await self.conn.recv())

    async def head(self) -> int:
        event = await self._event()
        if isinstance(event, h11.ConnectionClosed):
            raise Cut("closed before the response head")
        assert isinstance(event, h11.Response), event
        self.status = event.status_code
        self.headers = {k.decode().lower(): v.decode() for k, v in event.headers}
        return event.status_code

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, until the end of the message (Cut if it never comes)."""
        while True:
            event = await self._event()
            if isinstance(event, h11.Data):
                self.body_bytes += len(event.data)
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise Cut(f"unexpected {type(event).__name__} in the body")

    async def read_body(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


class WsClient:
    """A WebSocket client session over a ``RawConn`` (JSON text messages)."""

    def __init__(self, conn: RawConn) -> None:
        self.conn = conn
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._pending: list[Event] = []
        self.closed_by_server = False

    async def handshake(self, path: str = "/v1/stream") -> None:
        await self.conn.send_all(self.ws.send(Request(host="127.0.0.1", target=path)))
        while True:
            event = await self._next()
            if isinstance(event, AcceptConnection):
                return
            if isinstance(event, RejectConnection):
                raise Cut(f"handshake refused: {event.status_code}")

    async def send(self, obj: dict[str, Any]) -> None:
        await self.conn.send_all(self.ws.send(Message(data=json.dumps(obj))))

    async def send_close(self) -> None:
        await self.conn.send_all(self.ws.send(CloseConnection(code=1000)))

    def message_bytes(self, obj: dict[str, Any]) -> bytes:
        """The frame for ``obj`` without sending it (a client may send only part)."""
        return self.ws.send(Message(data=json.dumps(obj)))

    async def _next(self) -> Event:
        while not self._pending:
            data = await self.conn.recv()
            if not data:
                raise Cut("the server closed the socket")
            self.ws.receive_data(data)
            self._pending.extend(self.ws.events())
        return self._pending.pop(0)

    async def receive(self) -> dict[str, Any]:
        """The next server message; raises Cut when the socket closes first."""
        text = ""
        while True:
            event = await self._next()
            if isinstance(event, TextMessage):
                text += event.data
                if event.message_finished:
                    return dict(json.loads(text))
            elif isinstance(event, Ping):
                await self.conn.send_all(self.ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self.closed_by_server = True
                raise Cut(f"the server closed the WebSocket ({event.code} {event.reason})")
