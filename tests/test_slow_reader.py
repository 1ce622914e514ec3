"""A steady slow reader is never cut, and a stalled one is cut visibly (issue 54, point 9).

Over real sockets with small buffers (the client's receive buffer 4 KiB, the server's
send buffer 4 KiB), so one large streamed item takes longer to read than
``send_timeout``. The send deadline counts time without progress, not the length of one
write: a client still reading gets the whole body. A client that reads nothing is cut,
and with a reset: its read fails instead of ending like a slow stream's.
"""

from __future__ import annotations

import socket
import time
from collections.abc import AsyncIterator

import anyio
import h11
import pytest

from transport import Request, Response, Router, ServerConfig, StreamResponse, aio
from transport.http11 import HTTPConnection

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ITEM = 384 * 1024  # one streamed item, one write
ITEMS = 2
READ = 4096  # the client reads at most this much ...
PAUSE = 0.008  # ... then waits this long: at most 512 KB/s, steady
SEND_TIMEOUT = 0.5
# However fast the machine, one item's write outlasts send_timeout.
assert ITEM / (READ / PAUSE) > 1.5 * SEND_TIMEOUT


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_router(reasons: list[str | None]) -> Router:
    router = Router()

    @router.route("GET", "/big")
    async def big(request: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            try:
                for i in range(ITEMS):
                    yield bytes([65 + i]) * ITEM
            finally:
                reasons.append(request.disconnect_reason)

        return StreamResponse(gen())

    return router


def _sockets() -> tuple[socket.socket, socket.socket]:
    """(server side, client side) of a loopback TCP connection with small buffers."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        client.connect(listener.getsockname())
        server, _ = listener.accept()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # no autotuning
    return server, client


def _read(client: socket.socket, pause_after_head: float) -> tuple[bytes, BaseException | None]:
    """Read the response at a steady rate (after a pause, if any) until EOF or error."""
    client.sendall(b"GET /big HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
    data = bytearray()
    try:
        data += client.recv(READ)
        time.sleep(pause_after_head)
        while chunk := client.recv(READ):
            data += chunk
            time.sleep(PAUSE)
    except OSError as exc:
        return bytes(data), exc
    return bytes(data), None


def _body(data: bytes) -> tuple[bytes, bool]:
    """The body h11 parses from ``data``, and whether it was terminated (EndOfMessage)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/big", headers=[("host", "t")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(data)
    body = bytearray()
    while True:
        event = conn.next_event()
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            return bytes(body), True
        elif event is h11.NEED_DATA:
            return bytes(body), False


async def _serve_one(pause_after_head: float) -> tuple[bytes, BaseException | None, list]:
    server_sock, client = _sockets()
    reasons: list[str | None] = []
    config = ServerConfig(send_timeout=SEND_TIMEOUT)
    with client:
        stream = await aio.AsyncioSocketStream.adopt(server_sock)
        conn = HTTPConnection(stream, make_router(reasons), config)
        async with anyio.create_task_group() as tg:
            tg.start_soon(conn.run)
            data, error = await anyio.to_thread.run_sync(_read, client, pause_after_head)
            tg.cancel_scope.cancel()
    return data, error, reasons


async def test_a_steady_slow_reader_gets_the_whole_body() -> None:
    start = time.monotonic()
    data, error, reasons = await _serve_one(pause_after_head=0)
    elapsed = time.monotonic() - start
    body, terminated = _body(data)
    assert error is None, (error, len(data))
    assert terminated, len(body)  # before: cut after ~0.5 s, 0.3 of its 0.75 MB
    assert body == b"A" * ITEM + b"B" * ITEM
    assert reasons == [None]
    assert elapsed > ITEMS * SEND_TIMEOUT, elapsed  # slow, not stalled


async def test_a_reader_that_stops_is_cut_with_a_reset() -> None:
    data, error, reasons = await _serve_one(pause_after_head=3 * SEND_TIMEOUT)
    assert reasons == ["send_stall"]
    # Before: the server's kernel went on sending what it held, then a FIN, and the
    # client's read ended like a slow stream's. Now its read fails.
    assert isinstance(error, ConnectionResetError), (error, len(data))
    assert not _body(data)[1]
