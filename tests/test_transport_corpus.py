"""A corpus of hostile requests (tests/transport_corpus.py), on the fast path and on h11.

Every case runs over a real socket pair through ``HTTPConnection`` twice at once: with
the fast path (``ServerConfig.fast_path``, the default) and with h11 alone. Each must get
the outcome the table promises, and the two must write the same bytes (give or take the
Date line): where they differ, the transport has a bug. Timeouts are a tenth of a second,
so the slow clients cost little.
"""

from __future__ import annotations

import re
import socket
from dataclasses import replace
from pathlib import Path

import anyio
import anyio.abc
import pytest

from transport import Router, ServerConfig
from transport.http11 import HTTPConnection

from .transport_corpus import CASES, DRIP, Case, Outcome, markdown_table
from .transport_helpers import RawClient, connect, echo_router, request_bytes, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

CONFIG = ServerConfig(
    header_timeout=0.1,
    body_timeout=0.1,
    keepalive_timeout=0.01,
    send_timeout=1.0,
    max_header_bytes=2048,
    max_body_bytes=4096,
    ws_max_message_bytes=1024,
)
_DATE = re.compile(rb"date: [^\r]*\r\n")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_router() -> Router:
    return echo_router(websocket=True)


async def exchange(data: bytes | list[bytes], fast: bool) -> bytes:
    """Send ``data`` (pieces ``DRIP`` apart), return all that comes back until the close."""
    left, right = socket.socketpair()
    server = await anyio.abc.SocketStream.from_socket(left)
    client = await anyio.abc.SocketStream.from_socket(right)
    conn = HTTPConnection(server, make_router(), replace(CONFIG, fast_path=fast))
    pieces = data if isinstance(data, list) else [data]
    received = b""

    async def send() -> None:
        for i, piece in enumerate(pieces):
            if i:
                await anyio.sleep(DRIP)
            try:
                await client.send(piece)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return  # the server gave up on us first, as it should have

    with anyio.fail_after(5):  # never a hang
        async with anyio.create_task_group() as tg:
            tg.start_soon(conn.run)  # an exception here fails the test: never a crash
            tg.start_soon(send)
            try:
                while True:
                    received += await client.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                pass
            finally:
                tg.cancel_scope.cancel()
                await client.aclose()
    return received


def outcome(received: bytes) -> Outcome:
    """The statuses of the responses in ``received``, whether the last one closes, and
    after a 101 the code of the server's close frame."""
    statuses: list[int] = []
    closes = True  # nothing at all came back: a silent close
    pos = 0
    while pos < len(received):
        end = received.index(b"\r\n\r\n", pos) + 4
        lines = received[pos:end].decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        statuses.append(status)
        fields = dict(line.lower().split(": ", 1) for line in lines[1:] if line)
        closes = fields.get("connection") == "close"
        if status == 101:
            return Outcome(tuple(statuses), False, _close_code(received[end:]))
        pos = end if status < 200 else _body_end(received, end, fields)
    return Outcome(tuple(statuses), closes)


def _body_end(data: bytes, start: int, fields: dict[str, str]) -> int:
    if "content-length" in fields:
        return start + int(fields["content-length"])
    pos = start  # chunked: the transport's error and echo responses are not, but be exact
    while True:
        eol = data.index(b"\r\n", pos)
        size = int(data[pos:eol], 16)
        pos = eol + 2 + size + 2
        if size == 0:
            return pos


def _close_code(frames: bytes) -> int | None:
    """The code of the first close frame the server sent (server frames are unmasked)."""
    pos = 0
    while pos + 2 <= len(frames):
        opcode, size = frames[pos] & 0x0F, frames[pos + 1] & 0x7F
        pos += 2
        if size == 126:
            size, pos = int.from_bytes(frames[pos : pos + 2], "big"), pos + 2
        if opcode == 8:
            return int.from_bytes(frames[pos : pos + 2], "big") if size >= 2 else 1005
        pos += size
    return None


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_hostile_input(case: Case) -> None:
    got: dict[bool, bytes] = {}

    async def run(fast: bool) -> None:
        got[fast] = await exchange(case.data, fast)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run, True)
        tg.start_soon(run, False)
    fast, slow = outcome(got[True]), outcome(got[False])
    assert (fast, slow) == (case.expect, case.expect), f"{case.what}: {got[True][:300]!r}"
    # The two paths write the same bytes: a difference is a bug in one of them.
    assert _DATE.sub(b"", got[True]) == _DATE.sub(b"", got[False])
    # The fuzz test's property: a 4xx or a close, never a 5xx but the two the RFCs ask for.
    assert all(s < 500 or (s in (501, 505) and fast.closes) for s in fast.statuses)


def test_the_corpus_is_large_and_each_name_is_unique() -> None:
    assert len(CASES) >= 60
    assert len({c.name for c in CASES}) == len(CASES)


async def test_the_switch_selects_the_path() -> None:
    for fast in (True, False):
        left, right = socket.socketpair()
        server = await anyio.abc.SocketStream.from_socket(left)
        client = RawClient(await anyio.abc.SocketStream.from_socket(right))
        conn = HTTPConnection(server, make_router(), replace(CONFIG, fast_path=fast))
        async with anyio.create_task_group() as tg:
            tg.start_soon(conn.run)
            await client.send(request_bytes("POST", "/echo", b"hi"))
            head, body = await client.response(method="POST")
            assert (head.status_code, body) == (200, b"hi")
            assert conn.channel.live is not fast  # h11 holds the state only without it
            await client.stream.aclose()


# -- named regressions, over TCP with the default (long) timeouts ---------------------------
SMUGGLE = (
    b"POST /echo HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5\r\nhello\r\n0\r\n\r\nGET / HTTP/1.1\r\nHost: a\r\n\r\n"
)


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "h11"])
async def test_content_length_with_chunked_is_400_and_close(fast: bool) -> None:
    """Issue 23: CL + TE was read as chunked and the connection stayed open, so the bytes
    after the chunked body were a second request (RFC 9112 section 6.3)."""
    async with running(make_router(), fast_path=fast) as (_, port):
        stream = await connect(port)
        client = RawClient(stream)
        await client.send(SMUGGLE)
        head, body = await client.response(method="POST")
        assert head.status_code == 400 and b"Transfer-Encoding" in body
        assert (b"connection", b"close") in head.headers
        assert await client.closed(timeout=2.0)  # at once, not at a 5 s keep-alive timeout
        await stream.aclose()


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "h11"])
async def test_body_timeout_response_says_close(fast: bool) -> None:
    """The h11 path answered a body timeout without ``Connection: close`` (the fast path
    said it), then closed: now both say it."""
    async with running(make_router(), fast_path=fast, body_timeout=0.1) as (_, port):
        stream = await connect(port)
        client = RawClient(stream)
        await client.send(request_bytes("POST", "/echo", b"x" * 100_000)[:-10])
        head, _ = await client.response(method="POST")
        assert head.status_code == 408 and (b"connection", b"close") in head.headers
        assert await client.closed(timeout=2.0)
        await stream.aclose()


def test_the_docs_table_is_the_corpus() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "transport.md").read_text()
    found = re.search(r"<!-- corpus: begin [^\n]*-->\n(.*?)<!-- corpus: end -->", doc, re.S)
    assert found is not None and found.group(1) == markdown_table()
