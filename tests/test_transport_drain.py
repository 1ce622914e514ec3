"""A drain answers every request it has read (issue 53 point 3), over real sockets.

While a server drains, each request the app has not seen gets 503 + Retry-After, and
the last answer on a connection says ``Connection: close`` before a clean close (FIN,
never a reset): the next request on an idle keep-alive connection, requests pipelined
behind the one in flight, and an upload still in progress, which is read to its end
first so that the client, which writes its whole body before it reads, sees the answer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
import anyio.abc
import h11
import pytest

from transport import Request, Response, Router, StreamResponse

from .transport_helpers import RawClient, connect, request_bytes, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

RETRY_AFTER = 7
BIG = 200_000  # a body past the fast path's 64 KiB: streamed to the handler through h11


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""


@dataclass
class Ending:
    """Everything a connection received until the server closed it."""

    answers: list[Answer] = field(default_factory=list)
    reset: bool = False  # ended by a reset (ECONNRESET), not a FIN
    complete: bool = True  # the last answer was whole

    def statuses(self) -> list[int]:
        return [a.status for a in self.answers]

    def closing(self) -> list[bool]:
        return [a.headers.get("connection") == "close" for a in self.answers]


def parse(data: bytes) -> tuple[list[Answer], bool]:
    """The responses in ``data`` (a whole connection's bytes), and whether the last is whole."""
    conn = h11.Connection(h11.CLIENT)
    conn.receive_data(data)
    conn.receive_data(b"")
    answers: list[Answer] = []
    while True:
        if conn.our_state is h11.IDLE:
            conn.send(h11.Request(method="GET", target="/", headers=[("host", "t")]))
            conn.send(h11.EndOfMessage())
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:  # the close came where the next answer would start
            return answers, conn.their_state is h11.SEND_RESPONSE and not conn.trailing_data[0]
        if isinstance(event, h11.Response):
            headers = {k.decode(): v.decode() for k, v in event.headers}
            answers.append(Answer(event.status_code, headers))
        elif isinstance(event, h11.Data):
            answers[-1].body += event.data
        elif isinstance(event, h11.EndOfMessage):
            if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                conn.start_next_cycle()
        elif isinstance(event, h11.ConnectionClosed):
            return answers, True
        else:  # NEED_DATA after EOF: a response cut short
            return answers, False


async def read_to_end(
    stream: anyio.abc.SocketStream, seconds: float = 10, data: bytes = b""
) -> Ending:
    """Read until the server closes; ``data``: what was already read off the connection."""
    reset = False
    with anyio.fail_after(seconds):
        while True:
            try:
                data += await stream.receive()
            except anyio.EndOfStream:
                break
            except (anyio.BrokenResourceError, OSError):
                reset = True
                break
    answers, complete = parse(data)
    return Ending(answers, reset, complete)


def drain_router(seen: list[str]) -> Router:
    """``/ok``, ``/slow`` (0.3 s), ``/stream`` (3 chunks over 0.3 s), ``POST /size`` (the
    body's length); ``seen`` records each request the app was handed."""
    router = Router()

    @router.route("GET", "/ok")
    async def ok(request: Request) -> Response:
        seen.append("ok")
        return Response(b"ok")

    @router.route("GET", "/slow")
    async def slow(request: Request) -> Response:
        seen.append("slow")
        await anyio.sleep(0.3)
        return Response(b"slow")

    @router.route("GET", "/stream")
    async def stream(request: Request) -> Response:
        seen.append("stream")

        async def chunks() -> AsyncIterator[bytes]:
            for i in range(3):
                await anyio.sleep(0.1)
                yield b"%d" % i

        return StreamResponse(chunks())

    @router.route("POST", "/size")
    async def size(request: Request) -> Response:
        seen.append("size")
        return Response(b"%d" % len(await request.body()))

    return router


def assert_refused(answer: Answer) -> None:
    assert answer.status == 503, answer
    assert answer.headers["retry-after"] == str(RETRY_AFTER)
    assert b"shutting down" in answer.body


# ------------------------------------------------------------------ idle keep-alive
async def test_idle_keepalive_connection_answers_503_during_a_drain() -> None:
    """A request on a keep-alive connection that was idle when the drain began gets 503
    + Retry-After + Connection: close, then a FIN; before, the drain closed the
    connection at once and a request already on its way met a close or a reset."""
    seen: list[str] = []
    async with running(drain_router(seen)) as (server, port), await connect(port) as sock:
        client = RawClient(sock)
        await client.send(request_bytes("GET", "/ok"))
        head, _ = await client.response()
        assert head.status_code == 200
        server.begin_drain(retry_after=RETRY_AFTER)
        await anyio.sleep(0.3)  # within drain_idle_timeout (1 s)
        await sock.send(request_bytes("GET", "/ok"))
        end = await read_to_end(sock)
    assert not end.reset and end.complete
    assert end.statuses() == [503] and end.closing() == [True]
    assert_refused(end.answers[0])
    assert seen == ["ok"]  # the app never saw the refused one


async def test_idle_keepalive_connection_closes_cleanly_after_its_drain_grace() -> None:
    async with running(drain_router([]), drain_idle_timeout=0.3) as (server, port):
        async with await connect(port) as sock:
            client = RawClient(sock)
            await client.send(request_bytes("GET", "/ok"))
            assert (await client.response())[0].status_code == 200
            start = anyio.current_time()
            server.begin_drain()
            end = await read_to_end(sock)
            waited = anyio.current_time() - start
    assert end.answers == [] and not end.reset
    assert 0.25 < waited < 1.5, waited


async def test_shutdown_alone_also_answers_the_idle_connections_next_request() -> None:
    """``shutdown()`` without ``begin_drain()`` drains the same way."""
    async with running(drain_router([]), shutdown_timeout=4) as (server, port):
        async with await connect(port) as sock, anyio.create_task_group() as tg:
            client = RawClient(sock)
            await client.send(request_bytes("GET", "/ok"))
            assert (await client.response())[0].status_code == 200
            tg.start_soon(server.shutdown)
            await anyio.sleep(0.2)
            await sock.send(request_bytes("GET", "/ok"))
            end = await read_to_end(sock)
    assert not end.reset and end.statuses() == [503] and end.closing() == [True]


# ------------------------------------------------------------------------ pipelined
async def test_pipelined_requests_behind_the_one_in_flight_all_get_answers() -> None:
    """Three requests pipelined behind a slow one that is running when the drain begins:
    four answers, the 503s with Retry-After, only the last saying Connection: close,
    then a FIN. The handler never looks at the socket, so the three wait in the
    stream's read-ahead, which the drain must count (before: the slow answer said close
    and the three were dropped unanswered)."""
    seen: list[str] = []
    async with running(drain_router(seen)) as (server, port), await connect(port) as sock:
        await sock.send(
            request_bytes("GET", "/slow")
            + request_bytes("GET", "/ok")
            + request_bytes("POST", "/size", b"x" * 1000)
            + request_bytes("GET", "/ok")
        )
        await anyio.sleep(0.1)
        server.begin_drain(retry_after=RETRY_AFTER)
        end = await read_to_end(sock)
    assert not end.reset and end.complete
    assert end.statuses() == [200, 503, 503, 503]
    assert end.closing() == [False, False, False, True]
    assert end.answers[0].body == b"slow"
    for answer in end.answers[1:]:
        assert_refused(answer)
    assert seen == ["slow"]


async def test_requests_pipelined_during_a_stream_get_answers_after_it() -> None:
    """A stream whose head went out before the drain (no Connection: close) finishes; the
    two requests the client pipelined behind it meanwhile get 503, the last with close."""
    async with running(drain_router([])) as (server, port), await connect(port) as sock:
        await sock.send(request_bytes("GET", "/stream"))
        first = await sock.receive()
        assert first.startswith(b"HTTP/1.1 200")
        server.begin_drain(retry_after=RETRY_AFTER)
        await sock.send(request_bytes("GET", "/ok") + request_bytes("GET", "/ok"))
        end = await read_to_end(sock, data=first)
    assert not end.reset and end.complete
    assert end.statuses() == [200, 503, 503] and end.closing() == [False, False, True]
    assert end.answers[0].body == b"012"


async def test_a_request_sent_after_a_streams_end_during_a_drain_gets_503() -> None:
    """The stream's head said keep-alive: once it ends, the connection waits its drain
    grace for the request the client may send next, and answers it 503 + close."""
    async with running(drain_router([])) as (server, port), await connect(port) as sock:
        client = RawClient(sock)
        await client.send(request_bytes("GET", "/stream"))
        await anyio.sleep(0.05)
        server.begin_drain(retry_after=RETRY_AFTER)
        head, body = await client.response()
        assert head.status_code == 200 and body == b"012"
        assert (b"connection", b"close") not in head.headers
        await sock.send(request_bytes("GET", "/ok"))
        end = await read_to_end(sock)
    assert not end.reset and end.statuses() == [503] and end.closing() == [True]


# ------------------------------------------------------------------------ slow upload
async def _upload(sock: anyio.abc.SocketStream, rest: bytes, pieces: int, pause: float) -> None:
    """Send ``rest`` in ``pieces``, ``pause`` s apart: every send must succeed."""
    step = -(-len(rest) // pieces)
    for i in range(0, len(rest), step):
        await anyio.sleep(pause)
        await sock.send(rest[i : i + step])


@pytest.mark.parametrize("size", [1000, BIG], ids=["unseen", "in-handler"])
async def test_slow_upload_at_drain_start_gets_a_full_answer(size: int) -> None:
    """An upload mid-body when the drain begins is read to its end and answered: 503
    when the app had not seen it yet (a small body the transport was still collecting),
    the handler's own answer when it was already reading it; Connection: close either
    way, every send of the body succeeds, and the close is a FIN."""
    seen: list[str] = []
    whole = request_bytes("POST", "/size", b"y" * size)
    head_and_some = len(whole) - size + size // 10
    async with running(drain_router(seen)) as (server, port), await connect(port) as sock:
        await sock.send(whole[:head_and_some])
        await anyio.sleep(0.1)
        server.begin_drain(retry_after=RETRY_AFTER)
        await _upload(sock, whole[head_and_some:], 6, 0.1)
        end = await read_to_end(sock)
    assert not end.reset and end.complete
    assert end.closing() == [True]
    if size == BIG:
        assert end.statuses() == [200] and end.answers[0].body == b"%d" % size
        assert seen == ["size"]
    else:
        assert end.statuses() == [503] and seen == []
        assert_refused(end.answers[0])


async def test_slow_upload_past_the_shutdown_deadline_still_reads_its_503() -> None:
    """The shutdown deadline passes while a body still uploads: the server answers 503
    then reads on while the client sends, so the client finishes its body (no broken
    pipe) and then reads the 503; before, a reset destroyed the answer."""
    whole = request_bytes("POST", "/size", b"z" * 1000)
    async with running(drain_router([])) as (server, port), await connect(port) as sock:
        await sock.send(whole[:-900])
        async with anyio.create_task_group() as tg:
            tg.start_soon(server.shutdown, 0.3)
            await _upload(sock, whole[-900:], 12, 0.15)  # 1.8 s: well past the deadline
        end = await read_to_end(sock)
    assert not end.reset and end.complete
    assert end.statuses() == [503] and end.closing() == [True]


async def test_expect_100_continue_during_a_drain_gets_503_without_the_body() -> None:
    """A client waiting for 100 Continue gets the 503 at once and need not send its body."""
    async with running(drain_router([])) as (server, port), await connect(port) as sock:
        server.begin_drain(retry_after=RETRY_AFTER)
        head = b"POST /size HTTP/1.1\r\nhost: t\r\ncontent-length: 5000\r\n"
        await sock.send(head + b"expect: 100-continue\r\n\r\n")
        end = await read_to_end(sock, 5)
    assert not end.reset and end.statuses() == [503] and end.closing() == [True]
