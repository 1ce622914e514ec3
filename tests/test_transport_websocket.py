"""WebSocket upgrade and sessions: echo, fragments, ping/pong, limits, close codes."""

from __future__ import annotations

from typing import Any

import anyio
import anyio.abc
import pytest
from websockets.asyncio.client import connect as ws_connect
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Pong,
    TextMessage,
)
from wsproto.events import (
    Request as WSRequest,
)

from transport import (
    Request,
    Response,
    Router,
    WebSocket,
    WebSocketClosed,
    WebSocketResponse,
)

from .transport_helpers import connect, request_bytes, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Seen:
    def __init__(self) -> None:
        self.closed: list[WebSocketClosed] = []
        self.done = anyio.Event()


def make_router(seen: Seen) -> Router:
    router = Router()

    async def echo_session(ws: WebSocket) -> None:
        try:
            while True:
                message = await ws.receive()
                await ws.send(message)
        except WebSocketClosed as exc:
            seen.closed.append(exc)
            raise
        finally:
            seen.done.set()

    @router.route("GET", "/ws")
    async def ws_endpoint(request: Request) -> Response:
        return WebSocketResponse(echo_session, subprotocol=request.headers.get("x-proto"))

    async def flood_session(ws: WebSocket) -> None:
        try:
            while True:
                await ws.send(b"y" * 65536)
        except WebSocketClosed as exc:
            seen.closed.append(exc)
        finally:
            seen.done.set()

    @router.route("GET", "/flood")
    async def flood(request: Request) -> Response:
        return WebSocketResponse(flood_session)

    return router


class WSClient:
    """A wsproto client on a raw socket, for exact control over frames."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)

    @classmethod
    async def open(cls, port: int, path: str = "/ws") -> WSClient:
        client = cls(await connect(port))
        await client.send(WSRequest(host="test", target=path))
        assert isinstance(await client.next_event(), AcceptConnection)
        return client

    async def send(self, event: Any) -> None:
        await self.stream.send(self.ws.send(event))

    async def next_event(self, timeout: float = 5.0) -> Any:
        with anyio.fail_after(timeout):
            while True:
                for event in self.ws.events():
                    return event
                try:
                    data: bytes | None = await self.stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    data = None
                self.ws.receive_data(data)


async def test_echo_with_a_real_client_and_subprotocol() -> None:
    seen = Seen()
    async with running(make_router(seen)) as (_, port):
        async with ws_connect(
            f"ws://127.0.0.1:{port}/ws",
            subprotocols=["chat"],
            additional_headers={"x-proto": "chat"},
        ) as ws:
            assert ws.subprotocol == "chat"
            await ws.send("hello")
            assert await ws.recv() == "hello"
            await ws.send(b"\x00\x01")
            assert await ws.recv() == b"\x00\x01"
        with anyio.fail_after(5):
            await seen.done.wait()
    assert seen.closed[0].code == 1000


async def test_fragmented_messages_are_reassembled() -> None:
    async with running(make_router(Seen())) as (_, port):
        client = await WSClient.open(port)
        await client.send(TextMessage(data="hel", message_finished=False))
        await client.send(TextMessage(data="lo é", message_finished=True))
        event = await client.next_event()
        assert isinstance(event, TextMessage) and event.data == "hello é"
        await client.send(BytesMessage(data=b"ab", message_finished=False))
        await client.send(BytesMessage(data=b"cd", message_finished=True))
        event = await client.next_event()
        assert isinstance(event, BytesMessage) and event.data == b"abcd"
        await client.stream.aclose()


async def test_ping_is_answered_with_pong_and_close_is_echoed() -> None:
    seen = Seen()
    async with running(make_router(seen)) as (_, port):
        client = await WSClient.open(port)
        await client.send(Ping(payload=b"p1"))
        event = await client.next_event()
        assert isinstance(event, Pong) and event.payload == b"p1"
        await client.send(CloseConnection(code=4001, reason="bye"))
        event = await client.next_event()
        assert isinstance(event, CloseConnection) and event.code == 4001
        with anyio.fail_after(5):
            await seen.done.wait()
        assert (seen.closed[0].code, seen.closed[0].reason) == (4001, "bye")
        await client.stream.aclose()


async def test_oversized_message_is_closed_with_1009() -> None:
    seen = Seen()
    async with running(make_router(seen), ws_max_message_bytes=1000) as (_, port):
        client = await WSClient.open(port)
        await client.send(BytesMessage(data=b"a" * 600, message_finished=False))
        await client.send(BytesMessage(data=b"a" * 600, message_finished=True))
        event = await client.next_event()
        assert isinstance(event, CloseConnection) and event.code == 1009
        with anyio.fail_after(5):
            await seen.done.wait()
        assert seen.closed[0].code == 1009
        await client.stream.aclose()


async def test_peer_that_stops_reading_blocks_then_stalls_the_sender() -> None:
    seen = Seen()
    async with running(make_router(seen), send_timeout=0.3) as (_, port):
        client = await WSClient.open(port, "/flood")  # and never reads again
        with anyio.fail_after(10):
            await seen.done.wait()
        assert seen.closed[0].code == 1006
        await client.stream.aclose()


async def test_bad_handshakes_get_400_or_426() -> None:
    async with running(make_router(Seen())) as (_, port):
        cases = [
            (request_bytes("GET", "/ws"), b"426"),
            (
                request_bytes(
                    "GET",
                    "/ws",
                    upgrade="websocket",
                    connection="upgrade",
                    sec_websocket_version="13",
                    sec_websocket_key="short",
                ),
                b"400",
            ),
            (
                request_bytes(
                    "GET",
                    "/ws",
                    upgrade="websocket",
                    connection="upgrade",
                    sec_websocket_version="8",
                    sec_websocket_key="dGhlIHNhbXBsZSBub25jZQ==",
                ),
                b"426",
            ),
        ]
        for raw, status in cases:
            async with await connect(port) as stream:
                await stream.send(raw)
                with anyio.fail_after(5):
                    data = await stream.receive()
                assert data.startswith(b"HTTP/1.1 " + status), data
