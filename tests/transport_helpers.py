"""Shared helpers for the transport tests: a running server and a raw h11 client."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import anyio
import anyio.abc
import h11

from transport import (
    Handler,
    Request,
    Response,
    Router,
    Server,
    ServerConfig,
    WebSocket,
    WebSocketResponse,
)

BASE = ServerConfig(port=0)


@asynccontextmanager
async def running(app: Handler, **overrides: Any) -> AsyncIterator[tuple[Server, int]]:
    """Serve ``app`` on an ephemeral loopback port; shut down gracefully on exit."""
    server = Server(app, replace(BASE, **overrides))
    async with anyio.create_task_group() as tg:
        bound = await tg.start(server.serve)
        try:
            yield server, bound[0][1]
        finally:
            with anyio.fail_after(15):
                await server.shutdown()


async def connect(port: int) -> anyio.abc.SocketStream:
    return await anyio.connect_tcp("127.0.0.1", port)


def request_bytes(method: str = "GET", path: str = "/", body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: test"]
    if body:
        lines.append(f"content-length: {len(body)}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_until_closed(stream: anyio.abc.SocketStream, seconds: float = 5) -> bytes:
    """Every byte the peer sends until it closes (or resets) the connection."""
    data = b""
    with anyio.fail_after(seconds):
        try:
            while chunk := await stream.receive():
                data += chunk
        except (anyio.EndOfStream, anyio.BrokenResourceError):
            pass
    return data


class RawClient:
    """A client that writes exact bytes and parses responses with h11."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self, data: bytes) -> None:
        await self.stream.send(data)

    async def _event(self) -> Any:
        while True:
            event = self.conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                data = b""
            self.conn.receive_data(data)

    async def response(self, timeout: float = 5.0, method: str = "GET") -> tuple[Any, bytes]:
        """The next response and its body; (ConnectionClosed(), b"") if the server closed.

        The bytes on the wire were written raw; h11's client side is told only the method,
        which is all it needs to frame the response.
        """
        if self.conn.our_state is h11.IDLE:
            self.conn.send(h11.Request(method=method, target="/", headers=[("host", "test")]))
            self.conn.send(h11.EndOfMessage())
        with anyio.fail_after(timeout):
            head = await self._event()
            if not isinstance(head, (h11.Response, h11.InformationalResponse)):
                return head, b""
            if isinstance(head, h11.InformationalResponse):
                return head, b""
            body = b""
            while True:
                event = await self._event()
                if isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    raise AssertionError(f"unexpected {event!r}")
            if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
                self.conn.start_next_cycle()
            return head, body

    async def closed(self, timeout: float = 5.0) -> bool:
        """True once the server closes the connection (EOF or reset) within ``timeout``."""
        with anyio.fail_after(timeout):
            while True:
                try:
                    if not await self.stream.receive():
                        return True
                except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                    return True


def reset(stream: anyio.abc.SocketStream) -> None:
    """Make the next close send RST instead of FIN (a client that vanishes)."""
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def echo_router(websocket: bool = False) -> Router:
    """``GET|POST /echo`` answers the body, ``GET /`` answers ``root``; with
    ``websocket``, ``GET /ws`` echoes WebSocket messages."""
    router = Router()

    @router.route(["GET", "POST"], "/echo")
    async def echo(request: Request) -> Response:
        return Response(await request.body())

    @router.route("GET", "/")
    async def root(request: Request) -> Response:
        return Response(b"root")

    if websocket:

        @router.route("GET", "/ws")
        async def ws(request: Request) -> Response:
            async def session(sock: WebSocket) -> None:
                while True:
                    await sock.send(await sock.receive())

            return WebSocketResponse(session)

    return router
