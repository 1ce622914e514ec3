"""The fast path agrees with h11 on everything it accepts, and the driver around it."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import anyio.abc
import h11
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from transport import Request, Response, Router, ServerConfig, http_util
from transport.fastpath import (
    LAST_CHUNK,
    NEED_BODY,
    NEED_MORE,
    FastRequest,
    encode_response,
    encode_stream_head,
    parse_request,
)
from transport.http11 import HTTPConnection

from .transport_helpers import RawClient, request_bytes

MAX_HEAD = 1024
MAX_BODY = 64

# ------------------------------------------------------------------ parser vs h11

_NAMES = [
    "host",
    "Host",
    "content-length",
    "Content-Length",
    "connection",
    "x-a",
    "X-Tok!",
    "transfer-encoding",
    "expect",
    "upgrade",
    "te",
    "bad name",
    "",
    "x\x00",
]
_VALUES = [
    "a",
    "5",
    "0",
    "007",
    "-1",
    "close",
    "Keep-Alive, CLOSE",
    "keep-alive",
    "chunked",
    "a b",
    " padded ",
    "\ttab",
    "x\x7fy",
    "caf\xe9",
    "",
    "a\x00b",
    "1, 1",
    "100-continue",
]


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    method = draw(st.sampled_from(["GET", "POST", "PUT", "HEAD", "X-Y", "G@T", "", "CONNECT"]))
    target = draw(st.sampled_from(["/", "/a?b=c", "/%20", "*", "http://h/", "/a b", "/\xe9"]))
    version = draw(st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "http/1.1"]))
    fields = draw(
        st.lists(st.tuples(st.sampled_from(_NAMES), st.sampled_from(_VALUES)), max_size=6)
    )
    if draw(st.booleans()):
        fields.insert(draw(st.integers(0, len(fields))), ("host", "h"))
    body = draw(st.binary(max_size=80))
    if draw(st.booleans()):
        fields.append(("content-length", str(len(body))))
    sep = draw(st.sampled_from([": ", ":", ":  ", " : "]))
    head = f"{method} {target} {version}\r\n" + "".join(f"{n}{sep}{v}\r\n" for n, v in fields)
    data = head.encode("latin-1") + b"\r\n" + body + draw(st.sampled_from([b"", b"GET / HT"]))
    cut = draw(st.integers(0, len(data)))
    return data[:cut] if draw(st.booleans()) else data


def h11_view(data: bytes) -> tuple[object, ...] | None:
    """What h11 makes of the bytes: the request, its body, keep-alive and leftovers."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)
    conn.receive_data(data)
    try:
        request = conn.next_event()
        assert type(request) is h11.Request
        body = b""
        while type(event := conn.next_event()) is h11.Data:
            body += event.data
        assert type(event) is h11.EndOfMessage
    except (h11.RemoteProtocolError, AssertionError):
        return None
    conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    conn.send(h11.EndOfMessage())
    close = conn.our_state is h11.MUST_CLOSE
    pairs = [(name, value) for name, value in request.headers]
    leftover = conn.trailing_data[0]
    return request.method, request.target, pairs, body, close, leftover


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(requests())
@example(b"GET / HTTP/1.1\r\nHost: a\r\n\r\n")
@example(b"POST /e HTTP/1.1\r\nhost: a\r\ncontent-length: 3\r\nConnection: close\r\n\r\nabcGET")
def test_every_request_the_fast_path_takes_h11_reads_the_same(data: bytes) -> None:
    found = parse_request(data, MAX_HEAD, MAX_BODY)
    if found is NEED_MORE:
        assert b"\r\n\r\n" not in data
        return
    if found is NEED_BODY:  # the head h11 would accept too; its body is short
        assert h11_view(data) is None
        return
    if found is None:
        return  # h11 decides: the driver hands these bytes over
    assert isinstance(found, FastRequest)
    view = h11_view(data)
    assert view is not None, f"the fast path accepted what h11 rejects: {data!r}"
    method, target, pairs, body, close, leftover = view
    assert (found.method.encode(), found.target.encode("latin-1")) == (method, target)
    assert (found.headers, found.body, found.close) == (pairs, body, close)
    assert data[found.size :] == leftover


def test_what_the_fast_path_declines() -> None:
    ok = b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: 2\r\n\r\nhi"
    assert isinstance(parse_request(ok, MAX_HEAD, MAX_BODY), FastRequest)
    assert parse_request(ok[:-1], MAX_HEAD, MAX_BODY) is NEED_BODY  # small: worth the wait
    assert parse_request(ok[:20], MAX_HEAD, MAX_BODY) is NEED_MORE
    assert parse_request(b"G" * (MAX_HEAD + 1), MAX_HEAD, MAX_BODY) is None  # h11 says 431
    assert parse_request(ok, MAX_HEAD, 1) is None  # large bodies stream through h11's queue
    for extra in (b"expect: 100-continue", b"transfer-encoding: chunked", b"upgrade: websocket"):
        assert parse_request(ok.replace(b"host: a", b"host: a\r\n" + extra), MAX_HEAD, 99) is None


# ---------------------------------------------------------------- writer vs h11

_RESPONSE_HEADERS = [
    ("content-type", "application/json"),
    ("X-Custom", "a b"),
    ("retry-after", "1"),
    ("cache-control", "no-cache"),
]


@settings(max_examples=300, deadline=None)
@given(
    status=st.sampled_from([200, 201, 204, 304, 404, 418, 499, 503, 599]),
    headers=st.lists(st.sampled_from(_RESPONSE_HEADERS), max_size=3),
    body=st.binary(max_size=40),
    head=st.booleans(),
    close=st.booleans(),
)
def test_the_fast_writer_writes_what_h11_writes(
    status: int, headers: list[tuple[str, str]], body: bytes, head: bool, close: bool
) -> None:
    reason = http_util.reason(status)
    date = b"Wed, 02 Dec 2026 12:00:00 GMT"  # one value for both: the clock may tick between
    preamble = b"date: " + date + b"\r\nserver: lifecycle\r\n"
    fast = encode_response(status, reason, preamble, headers, body, head, close)
    conn = h11.Connection(h11.SERVER)
    extra = b"connection: close\r\n" if close else b""
    conn.receive_data(b"%s / HTTP/1.1\r\nhost: a\r\n%s\r\n" % (b"HEAD" if head else b"GET", extra))
    while type(conn.next_event()) is not h11.EndOfMessage:
        pass
    pairs = [(b"date", date), (b"server", b"lifecycle")]
    pairs += [(name.encode(), value.encode()) for name, value in headers]
    if status not in (204, 304):
        pairs.append((b"content-length", str(len(body)).encode()))
    expected = conn.send(h11.Response(status_code=status, headers=pairs, reason=reason))
    if body and status not in (204, 304) and not head:
        expected += conn.send(h11.Data(data=body))
    expected += conn.send(h11.EndOfMessage())
    assert fast == expected


@settings(max_examples=200, deadline=None)
@given(
    status=st.sampled_from([200, 201, 404, 418, 503, 599]),
    headers=st.lists(st.sampled_from(_RESPONSE_HEADERS), max_size=3),
    chunks=st.lists(st.binary(min_size=1, max_size=40), max_size=4),
    close=st.booleans(),
)
def test_the_fast_stream_writer_writes_what_h11_writes(
    status: int, headers: list[tuple[str, str]], chunks: list[bytes], close: bool
) -> None:
    """A streamed body to a client that may have asked to close: head, chunks, last chunk."""
    reason = http_util.reason(status)
    date = b"Wed, 02 Dec 2026 12:00:00 GMT"
    preamble = b"date: " + date + b"\r\nserver: lifecycle\r\n"
    head = encode_stream_head(status, reason, preamble, headers, close)
    assert head is not None
    fast = head + b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + LAST_CHUNK
    conn = h11.Connection(h11.SERVER)
    extra = b"connection: close\r\n" if close else b""
    conn.receive_data(b"GET / HTTP/1.1\r\nhost: a\r\n%s\r\n" % extra)
    while type(conn.next_event()) is not h11.EndOfMessage:
        pass
    pairs = [(b"date", date), (b"server", b"lifecycle")]
    pairs += [(name.encode(), value.encode()) for name, value in headers]
    expected = conn.send(h11.Response(status_code=status, headers=pairs, reason=reason))
    for c in chunks:
        expected += conn.send(h11.Data(data=c))
    expected += conn.send(h11.EndOfMessage())
    assert fast == expected


def test_headers_the_fast_writer_leaves_to_h11() -> None:
    preamble = http_util.preamble("lifecycle")
    for header in [
        ("x-bad", "a\r\nb"),
        ("bad name", "x"),
        ("connection", "close"),
        ("content-length", "3"),
        ("transfer-encoding", "chunked"),
    ]:
        assert encode_response(200, b"OK", preamble, [header], b"", False, False) is None
        assert encode_stream_head(200, b"OK", preamble, [header], False) is None
    assert encode_response(101, b"", preamble, [], b"", False, False) is None
    for status in (101, 204, 304):  # no body, so no chunked framing: h11 decides
        assert encode_stream_head(status, b"", preamble, [], False) is None


# ------------------------------------------------------------------------- driver


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_router(seen: list[str | None]) -> Router:
    router = Router()

    @router.route(["GET", "POST"], "/echo")
    async def echo(request: Request) -> Response:
        return Response(await request.body())

    @router.route("GET", "/peek")
    async def peek(request: Request) -> Response:
        await anyio.sleep(0.05)  # long enough for a pipelined request to arrive meanwhile
        return Response(b"gone" if request.disconnected.is_set() else b"here")

    @router.route("GET", "/wait")
    async def wait(request: Request) -> Response:
        await request.disconnected.wait()
        seen.append(request.disconnect_reason)
        return Response(b"never seen")

    @router.route("GET", "/bad-header")
    async def bad_header(request: Request) -> Response:
        return Response(b"x", headers=[("x-bad", "a\r\nb")])

    @router.route("GET", "/close")
    async def close(request: Request) -> Response:
        return Response(b"bye", headers=[("connection", "close")])

    return router


@asynccontextmanager
async def connection(seen: list[str | None]) -> AsyncIterator[tuple[HTTPConnection, RawClient]]:
    left, right = socket.socketpair()
    server = await anyio.abc.SocketStream.from_socket(left)
    client = await anyio.abc.SocketStream.from_socket(right)
    conn = HTTPConnection(server, make_router(seen), ServerConfig())
    async with anyio.create_task_group() as tg:
        tg.start_soon(conn.run)
        try:
            yield conn, RawClient(client)
        finally:
            await client.aclose()


@pytest.mark.anyio
async def test_plain_requests_need_no_second_task() -> None:
    async with connection([]) as (conn, client):
        for i in range(3):
            await client.send(request_bytes("POST", "/echo", b"n%d" % i))
            head, body = await client.response(method="POST")
            assert (head.status_code, body) == (200, b"n%d" % i)
        assert not conn.reader.watching and not conn.channel.live


@pytest.mark.anyio
async def test_reader_task_starts_on_first_look_and_serves_the_rest() -> None:
    seen: list[str | None] = []
    async with connection(seen) as (conn, client):
        for _ in range(3):
            await client.send(request_bytes("GET", "/peek"))
            await anyio.sleep(0.01)  # the next request lands while the watcher reads
            await client.send(request_bytes("POST", "/echo", b"after"))
            assert (await client.response())[1] == b"here"
            assert (await client.response(method="POST"))[1] == b"after"
        assert conn.reader.watching  # started by the first /peek, reading ever since
        await client.send(request_bytes("GET", "/wait"))
        await anyio.sleep(0.05)
        sock = client.stream.extra(anyio.abc.SocketAttribute.raw_socket)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01" + b"\x00" * 7)
    with anyio.fail_after(2):
        while not seen:
            await anyio.sleep(0.01)
    assert seen == ["client_gone"]


@pytest.mark.anyio
async def test_h11_and_fast_requests_interleave_on_one_connection() -> None:
    chunked = (
        b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\r\nmid\r\n0\r\n\r\n"
    )
    async with connection([]) as (conn, client):
        await client.send(request_bytes("POST", "/echo", b"one") + chunked)
        await client.send(request_bytes("POST", "/echo", b"three"))
        bodies = [(await client.response(method="POST"))[1] for _ in range(3)]
        assert bodies == [b"one", b"mid", b"three"]
        assert not conn.channel.live  # h11 was idle and empty again: back on the fast path


@pytest.mark.anyio
async def test_a_response_the_fast_path_declines_is_written_by_h11() -> None:
    async with connection([]) as (_, client):
        await client.send(request_bytes("GET", "/close"))
        head, body = await client.response()
        assert body == b"bye" and (b"connection", b"close") in head.headers
        assert await client.closed()
    async with connection([]) as (_, client):
        await client.send(request_bytes("GET", "/bad-header"))  # h11 refuses it: close
        received = b""
        with anyio.fail_after(5):
            try:
                while chunk := await client.stream.receive():
                    received += chunk
            except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
                pass
        assert received == b""  # the invalid header never reached the wire


@pytest.mark.anyio
async def test_head_and_body_written_apart_stay_on_the_fast_path() -> None:
    async with connection([]) as (conn, client):
        data = request_bytes("POST", "/echo", b"later")
        await client.send(data[:-5])  # as httpx does: the head, then the body
        await anyio.sleep(0.02)
        await client.send(data[-5:])
        assert (await client.response(method="POST"))[1] == b"later"
        assert not conn.channel.live


@pytest.mark.anyio
async def test_small_body_that_never_comes_is_408() -> None:
    left, right = socket.socketpair()
    server = await anyio.abc.SocketStream.from_socket(left)
    client = RawClient(await anyio.abc.SocketStream.from_socket(right))
    conn = HTTPConnection(server, make_router([]), ServerConfig(body_timeout=0.1))
    async with anyio.create_task_group() as tg:
        tg.start_soon(conn.run)
        await client.send(request_bytes("POST", "/echo", b"promised")[:-3])
        head, _ = await client.response(method="POST")
        assert head.status_code == 408
        assert await client.closed()
        await client.stream.aclose()
