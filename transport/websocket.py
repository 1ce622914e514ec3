"""WebSocket sessions (RFC 6455) on wsproto, started from an h11 upgrade request."""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
from collections.abc import Awaitable, Callable

import anyio
import anyio.abc
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import (
    BytesMessage,
    CloseConnection,
    Message,
    Ping,
    Pong,
    TextMessage,
)

from .config import ServerConfig
from .errors import HTTPError
from .request import Request

__all__ = [
    "WebSocket",
    "WebSocketClosed",
    "accept_headers",
    "handshake_problem",
    "run_session",
]

log = logging.getLogger("transport")

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"  # RFC 6455 section 1.3
_INBOX_MESSAGES = 16  # a session that stops receiving stops our reads after this many
_CLOSE_WAIT = 2.0  # how long we wait for the peer's close frame after sending ours
_STREAM_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class WebSocketClosed(Exception):
    """The WebSocket is closed: by the peer (its code), by us, or by a lost connection (1006)."""

    def __init__(self, code: int, reason: str = "") -> None:
        super().__init__(code, reason)
        self.code = code
        self.reason = reason


def _tokens(value: str | None) -> set[str]:
    return {t.strip().lower() for t in (value or "").split(",")}


def handshake_problem(request: Request) -> HTTPError | None:
    """Why this request cannot be upgraded (RFC 6455 section 4.2.1), or None."""
    headers = request.headers
    upgrade_required = HTTPError(
        426,
        "WebSocket upgrade required",
        headers=[("upgrade", "websocket"), ("sec-websocket-version", "13")],
    )
    if request.method != "GET" or "websocket" not in _tokens(headers.get("upgrade")):
        return upgrade_required
    if "upgrade" not in _tokens(headers.get("connection")):
        return HTTPError(400, "WebSocket handshake needs 'Connection: Upgrade'")
    if headers.get("sec-websocket-version") != "13":
        return upgrade_required  # section 4.4: answer with the versions we support
    key = headers.get("sec-websocket-key") or ""
    try:
        if len(base64.b64decode(key, validate=True)) != 16:
            raise ValueError(key)
    except (binascii.Error, ValueError):
        return HTTPError(400, "Invalid Sec-WebSocket-Key")
    return None


def accept_headers(
    request: Request, subprotocol: str | None, config: ServerConfig
) -> list[tuple[bytes, bytes]]:
    key = (request.headers.get("sec-websocket-key") or "").encode("ascii")
    accept = base64.b64encode(hashlib.sha1(key + _GUID).digest())
    headers = [
        (b"upgrade", b"websocket"),
        (b"connection", b"Upgrade"),
        (b"sec-websocket-accept", accept),
        (b"server", config.server_header.encode("latin-1")),
    ]
    if subprotocol is not None:
        headers.append((b"sec-websocket-protocol", subprotocol.encode("latin-1")))
    return headers


class WebSocket:
    """An accepted WebSocket, handed to the session function of a ``WebSocketResponse``."""

    def __init__(
        self,
        request: Request,
        stream: anyio.abc.ByteStream,
        config: ServerConfig,
        trailing: bytes = b"",
    ) -> None:
        self.request = request
        self._stream = stream
        self._config = config
        self._ws = Connection(ConnectionType.SERVER, trailing_data=trailing)
        self._inbox_send, self._inbox_recv = anyio.create_memory_object_stream[str | bytes](
            _INBOX_MESSAGES
        )
        self._send_lock = anyio.Lock()
        self._closed: WebSocketClosed | None = None
        self._parts: list[str | bytes] = []
        self._size = 0
        self.reader_done = anyio.Event()
        self._session_scope = anyio.CancelScope()
        self._going_away = False

    def go_away(self) -> None:
        """End the session now and close with 1001 (RFC 6455 section 7.4.1: the server
        is going away), not a reset: the server is shutting down."""
        self._going_away = True
        self._session_scope.cancel()

    @property
    def closed(self) -> WebSocketClosed | None:
        return self._closed

    async def receive(self) -> str | bytes:
        try:
            return await self._inbox_recv.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise self._closed or WebSocketClosed(1006, "connection lost") from None

    async def send(self, message: str | bytes) -> None:
        event: Message = (
            TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        )
        await self._send_event(event)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        if self._ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            if self._closed is None:
                self._closed = WebSocketClosed(code, reason)
            try:
                await self._send_event(CloseConnection(code=code, reason=reason))
            except WebSocketClosed:
                pass

    async def _send_event(self, event: Message | CloseConnection | Ping | Pong) -> None:
        async with self._send_lock:
            if self._ws.state is not ConnectionState.OPEN and not isinstance(
                event, CloseConnection
            ):
                raise self._closed or WebSocketClosed(1006, "connection lost")
            data = self._ws.send(event)
            try:
                # A peer that stops reading blocks this write once the socket buffers are
                # full: that is the backpressure, bounded in time by send_timeout.
                with anyio.fail_after(self._config.send_timeout):
                    await self._stream.send(data)
            except TimeoutError:
                self._lost("send_stall", "send stalled")
            except _STREAM_ERRORS:
                self._lost("client_gone", "connection lost")

    def _lost(self, reason: str, text: str) -> None:
        self.request.mark_disconnected(reason)
        if self._closed is None:
            self._closed = WebSocketClosed(1006, text)
        raise self._closed

    # ------------------------------------------------------------------ reader
    async def read_loop(self) -> None:
        try:
            with self._inbox_send:
                while await self._handle_events():
                    try:
                        data: bytes | None = await self._stream.receive(65536)
                    except (anyio.EndOfStream, *_STREAM_ERRORS):
                        data = None
                    self._ws.receive_data(data)
                    if data is None:
                        self.request.mark_disconnected("client_gone")
                        await self._handle_events()
                        return
        except WebSocketClosed:
            pass  # a write failed while answering a ping or a close
        finally:
            self.reader_done.set()

    async def _handle_events(self) -> bool:
        for event in self._ws.events():
            if isinstance(event, (TextMessage, BytesMessage)):
                if not await self._on_fragment(event):
                    return False
            elif isinstance(event, Ping):
                await self._send_event(event.response())
            elif isinstance(event, CloseConnection):
                if self._closed is None:
                    self._closed = WebSocketClosed(event.code, event.reason or "")
                if self._ws.state is ConnectionState.REMOTE_CLOSING:
                    await self._send_event(event.response())  # echo the close (section 5.5.1)
                elif self._ws.state is ConnectionState.OPEN:  # a frame we could not parse
                    await self._send_event(CloseConnection(code=event.code, reason=event.reason))
                return False
        return True

    async def _on_fragment(self, event: Message) -> bool:
        data = event.data
        self._size += len(data.encode("utf-8")) if isinstance(data, str) else len(data)
        if self._size > self._config.ws_max_message_bytes:
            self._closed = WebSocketClosed(1009, "Message too big")
            await self._send_event(CloseConnection(code=1009, reason="Message too big"))
            return False
        self._parts.append(data)
        if not event.message_finished:
            return True
        parts, self._parts, self._size = self._parts, [], 0
        if isinstance(event, TextMessage):
            message: str | bytes = "".join(parts)  # type: ignore[arg-type]
        else:
            message = b"".join(parts)  # type: ignore[arg-type]
        await self._inbox_send.send(message)
        return True

    async def ping_loop(self, interval: float) -> None:
        while True:
            await anyio.sleep(interval)
            await self._send_event(Ping(payload=b"lifecycle"))


async def run_session(
    stream: anyio.abc.ByteStream,
    request: Request,
    session: Callable[[WebSocket], Awaitable[None]],
    config: ServerConfig,
    trailing: bytes,
    opened: Callable[[WebSocket], None] | None = None,
) -> None:
    """Run ``session`` on an upgraded connection; close 1000 when it returns, 1011 on
    error, 1001 after ``WebSocket.go_away``. ``opened`` learns the WebSocket first."""
    ws = WebSocket(request, stream, config, trailing)
    if opened is not None:
        opened(ws)
    with ws._inbox_recv:
        await _supervise(ws, session, config)


async def _supervise(
    ws: WebSocket, session: Callable[[WebSocket], Awaitable[None]], config: ServerConfig
) -> None:
    request = ws.request
    async with anyio.create_task_group() as tg:
        tg.start_soon(ws.read_loop)
        if config.ws_ping_interval:
            tg.start_soon(_pings, ws, config.ws_ping_interval)
        try:
            with ws._session_scope:
                await session(ws)
            if ws._going_away:
                with anyio.CancelScope(shield=True):
                    await ws.close(1001, "server shutting down")
            await ws.close(1000)
        except WebSocketClosed:
            await ws.close(1000)
        except Exception:
            log.exception("unhandled error in WebSocket session for %s", request.path)
            await ws.close(1011, "Internal Error")
        with anyio.move_on_after(_CLOSE_WAIT):
            await ws.reader_done.wait()
        tg.cancel_scope.cancel()


async def _pings(ws: WebSocket, interval: float) -> None:
    try:
        await ws.ping_loop(interval)
    except WebSocketClosed:
        pass
