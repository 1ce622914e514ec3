"""Simulated clients over in-memory connections: raw HTTP/1.1 (keep-alive and
pipelined, read through h11 as a client) and the ``/v1/stream`` WebSocket (wsproto).

A client reads slowly or at once, and may leave at any point: FIN (``close``), RST
(``reset``), or a half-close after its request (``send_eof``, then it still reads).
What it saw is kept in an ``Answer`` per request, which the invariants judge.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio
import h11
import orjson
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Message,
    Ping,
    RejectConnection,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from tests.dsim.net import PipeEnd

__all__ = ["Answer", "HttpClient", "WsClient", "request_bytes"]


@dataclass(slots=True)
class Answer:
    """What one client request got."""

    label: str  # the scenario's name for the request (its rid, or a WebSocket id)
    status: int | None = None
    body: bytes = b""
    complete: bool = False  # the whole response (or a WebSocket terminal message) arrived
    events: list[Any] = field(default_factory=list)  # SSE data or WebSocket messages
    left: bool = False  # the client left before the end (its own choice)
    left_at: float | None = None  # when it left, in virtual time (not set by a half-close)
    cut: str | None = None  # how the server ended the connection early, if it did
    retry_after: str | None = None
    close_code: int | None = None  # WebSocket close code from the server


def request_bytes(method: str, path: str, body: bytes, *, close: bool = False) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: sim\r\n"
    if body or method == "POST":
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + body


class _Reader:
    """Bytes from a connection in the client's rhythm: ``chunk`` bytes at a time, with
    ``pause`` virtual seconds before each read."""

    def __init__(self, end: PipeEnd, chunk: int, pause: float) -> None:
        self.end, self.chunk, self.pause = end, chunk, pause
        self.got = 0

    async def read(self) -> bytes:
        if self.pause:
            await anyio.sleep(self.pause)
        try:
            data = await self.end.receive(self.chunk)
        except anyio.EndOfStream:
            return b""
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise ConnectionResetError from None
        self.got += len(data)
        return data


class HttpClient:
    """HTTP/1.1 over one connection; responses are read in the order requests were sent."""

    def __init__(self, end: PipeEnd, chunk: int = 65536, pause: float = 0.0) -> None:
        self.end = end
        self.h11 = h11.Connection(h11.CLIENT)
        self.reader = _Reader(end, chunk, pause)

    async def send(self, data: bytes) -> bool:
        try:
            await self.end.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    async def read_response(
        self, answer: Answer, method: str, *, leave_after: int | None = None
    ) -> None:
        """Read one response into ``answer``; with ``leave_after``, stop (the caller leaves)
        once that many body bytes arrived."""
        conn = self.h11
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
        if conn.our_state is not h11.IDLE:
            answer.cut = "connection not reusable"
            return
        conn.send(
            h11.Request(
                method=method, target="/", headers=[("host", "sim"), ("content-length", "0")]
            )
        )
        conn.send(h11.EndOfMessage())
        body = bytearray()
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError as exc:
                answer.cut = f"bad response: {exc}"
                return
            if event is h11.NEED_DATA:
                try:
                    data = await self.reader.read()
                except ConnectionResetError:
                    answer.cut = "reset"
                    return
                if not data:
                    try:
                        conn.receive_data(b"")
                    except h11.RemoteProtocolError:
                        pass
                    if conn.their_state is not h11.DONE:
                        answer.cut = "closed"
                        answer.body = bytes(body)
                        return
                    continue
                conn.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                answer.status = event.status_code
                for k, v in event.headers:
                    if k == b"retry-after":
                        answer.retry_after = v.decode()
            elif isinstance(event, h11.Data):
                body += event.data
                if leave_after is not None and len(body) >= leave_after:
                    answer.body = bytes(body)
                    answer.left, answer.left_at = True, anyio.current_time()
                    return
            elif isinstance(event, h11.EndOfMessage):
                answer.body = bytes(body)
                answer.complete = True
                answer.events = sse_events(answer.body)
                return
            elif isinstance(event, h11.ConnectionClosed):
                answer.cut = "closed"
                answer.body = bytes(body)
                return

    async def close(self) -> None:
        await self.end.aclose()


def sse_events(body: bytes) -> list[Any]:
    """The data of each SSE event in ``body`` (``[DONE]`` as the string), [] if not SSE."""
    if not body.startswith(b"data:") and b"\ndata:" not in body[:200]:
        return []
    out: list[Any] = []
    for block in body.split(b"\n\n"):
        for line in block.split(b"\n"):
            if line.startswith(b"data:"):
                data = line[5:].strip()
                out.append("[DONE]" if data == b"[DONE]" else orjson.loads(data))
    return out


class WsClient:
    """A ``/v1/stream`` session: JSON messages, several generations at once."""

    def __init__(self, end: PipeEnd, chunk: int = 65536, pause: float = 0.0) -> None:
        self.end = end
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.reader = _Reader(end, chunk, pause)
        self.close_code: int | None = None

    async def handshake(self) -> bool:
        if not await self._send(self.ws.send(Request(host="sim", target="/v1/stream"))):
            return False
        while True:
            events = await self._events()
            if events is None:
                return False
            for e in events:
                if isinstance(e, AcceptConnection):
                    self._pending = [x for x in events if x is not e]
                    return True
                if isinstance(e, RejectConnection):
                    return False

    async def _send(self, data: bytes) -> bool:
        try:
            await self.end.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True

    async def send(self, obj: dict[str, Any]) -> bool:
        """False once the session is closing (the server sent its close frame, 1001 on a
        drain): a real client library raises there, as wsproto does."""
        try:
            data = self.ws.send(Message(data=orjson.dumps(obj).decode()))
        except LocalProtocolError:
            return False
        return await self._send(data)

    async def _events(self) -> list[Any] | None:
        try:
            data = await self.reader.read()
        except ConnectionResetError:
            return None
        if not data:
            return None
        self.ws.receive_data(data)
        return list(self.ws.events())

    async def messages(self) -> Any:
        """Server messages until the socket ends; then ``self.close_code`` says how
        (None: no close frame, the connection just ended)."""
        pending: list[Any] = getattr(self, "_pending", [])
        text = ""
        while True:
            while not pending:
                got = await self._events()
                if got is None:
                    return
                pending = got
            event = pending.pop(0)
            if isinstance(event, TextMessage):
                text += event.data
                if event.message_finished:
                    yield orjson.loads(text)
                    text = ""
            elif isinstance(event, Ping):
                await self._send(self.ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                self.close_code = event.code
                await self._send(self.ws.send(event.response()))
                return

    async def send_close(self) -> None:
        try:
            data = self.ws.send(CloseConnection(code=1000))
        except LocalProtocolError:  # the server closed first
            return
        await self._send(data)
