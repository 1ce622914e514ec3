"""Every limit produces the right status or close within its timeout; hostile clients."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

from transport import Request, Response, Router, SSEResponse

from .transport_helpers import RawClient, connect, request_bytes, reset, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class Probe:
    """What the handlers under test saw, for assertions after the fact."""

    def __init__(self) -> None:
        self.calls = 0
        self.reasons: list[str | None] = []
        self.produced = 0
        self.finalized = anyio.Event()
        self.started = anyio.Event()


def make_router(probe: Probe) -> Router:
    router = Router()

    @router.route("POST", "/echo")
    async def echo(request: Request) -> Response:
        probe.calls += 1
        return Response(await request.body())

    @router.route("GET", "/ok")
    async def ok(request: Request) -> Response:
        return Response(b"ok")

    @router.route("GET", "/wait")
    async def wait(request: Request) -> Response:
        probe.started.set()
        await request.disconnected.wait()  # a handler blocked on something else
        probe.reasons.append(request.disconnect_reason)
        probe.finalized.set()
        return Response(b"never seen")

    @router.route("GET", "/firehose")
    async def firehose(request: Request) -> Response:
        async def gen() -> AsyncIterator[bytes]:
            try:
                while True:
                    probe.produced += 1
                    probe.started.set()
                    yield b"x" * 65536
            finally:
                probe.reasons.append(request.disconnect_reason)
                probe.finalized.set()

        return SSEResponse(gen())

    @router.route("GET", "/slow-events")
    async def slow_events(request: Request) -> Response:
        async def gen() -> AsyncIterator[str]:
            try:
                for i in range(1000):
                    yield str(i)
                    probe.started.set()
                    await anyio.sleep(0.01)
            finally:
                probe.reasons.append(request.disconnect_reason)
                probe.finalized.set()

        return SSEResponse(gen())

    return router


async def read_all(stream: anyio.abc.SocketStream, timeout: float) -> bytes:
    data = b""
    with anyio.fail_after(timeout):
        try:
            while True:
                data += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionResetError):
            return data


async def test_oversized_header_is_431_then_close() -> None:
    async with running(make_router(Probe()), max_header_bytes=1024) as (_, port):
        async with await connect(port) as stream:
            await stream.send(b"GET /ok HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * 4000 + b"\r\n\r\n")
            data = await read_all(stream, 5)
    assert data.startswith(b"HTTP/1.1 431 ")
    assert b"error" in data


async def test_declared_oversized_body_is_413_without_calling_the_handler() -> None:
    probe = Probe()
    async with running(make_router(probe), max_body_bytes=1000) as (_, port):
        async with await connect(port) as stream:
            await stream.send(request_bytes("POST", "/echo", content_length="5000"))
            data = await read_all(stream, 5)
    assert data.startswith(b"HTTP/1.1 413 ") and probe.calls == 0


async def test_chunked_body_over_the_limit_is_413() -> None:
    probe = Probe()
    async with running(make_router(probe), max_body_bytes=1000) as (_, port):
        async with await connect(port) as stream:
            await stream.send(
                b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n"
            )
            for _ in range(3):
                await stream.send(b"200\r\n" + b"b" * 512 + b"\r\n")
            data = await read_all(stream, 5)
    assert data.startswith(b"HTTP/1.1 413 ")


async def test_header_timeout_answers_408_for_a_partial_head() -> None:
    async with running(make_router(Probe()), header_timeout=0.2) as (_, port):
        async with await connect(port) as stream:
            start = time.monotonic()
            await stream.send(b"GET /ok HTTP/1.1\r\nhost: t\r\n")
            data = await read_all(stream, 5)
            elapsed = time.monotonic() - start
    assert data.startswith(b"HTTP/1.1 408 ") and 0.15 < elapsed < 1.5


async def test_silent_connection_is_closed_after_header_timeout() -> None:
    async with running(make_router(Probe()), header_timeout=0.2) as (_, port):
        async with await connect(port) as stream:
            start = time.monotonic()
            data = await read_all(stream, 5)
    assert data == b"" and 0.15 < time.monotonic() - start < 1.5


async def test_idle_keepalive_connection_is_closed_after_keepalive_timeout() -> None:
    async with running(make_router(Probe()), keepalive_timeout=0.2) as (_, port):
        async with await connect(port) as stream:
            client = RawClient(stream)
            await client.send(request_bytes("GET", "/ok"))
            response, _ = await client.response()
            start = time.monotonic()
            assert response.status_code == 200 and await client.closed(timeout=5)
            assert 0.15 < time.monotonic() - start < 1.5


async def test_body_timeout_answers_408() -> None:
    async with running(make_router(Probe()), body_timeout=0.2) as (_, port):
        async with await connect(port) as stream:
            await stream.send(request_bytes("POST", "/echo", content_length="100") + b"partial")
            data = await read_all(stream, 5)
    assert data.startswith(b"HTTP/1.1 408 ")


async def test_connections_beyond_the_limit_get_503() -> None:
    async with running(make_router(Probe()), max_connections=2) as (server, port):
        held = [await connect(port) for _ in range(2)]
        await anyio.sleep(0.1)  # let the server register both
        async with await connect(port) as extra:
            await extra.send(request_bytes("GET", "/ok"))
            data = await read_all(extra, 5)
        assert data.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in data
        for stream in held:
            await stream.aclose()
        await anyio.sleep(0.1)
        async with httpx.AsyncClient() as http:  # capacity is back once they leave
            assert (await http.get(f"http://127.0.0.1:{port}/ok")).status_code == 200


async def test_slowloris_does_not_starve_a_normal_client() -> None:
    # The shipping defaults (connection limit, open-file limit raised by the server).
    async with running(make_router(Probe())) as (_, port):
        attackers = []
        try:
            for _ in range(1000):
                stream = await connect(port)
                await stream.send(b"GET / HTTP/1.1\r\n")
                attackers.append(stream)
            for stream in attackers:  # trickle one more header byte each
                await stream.send(b"X")
            async with httpx.AsyncClient() as http:
                start = time.monotonic()
                r = await http.get(f"http://127.0.0.1:{port}/ok")
                elapsed = time.monotonic() - start
            assert r.status_code == 200 and elapsed < 1.0, elapsed
        finally:
            for stream in attackers:
                await stream.aclose()


async def test_client_reset_wakes_a_waiting_handler() -> None:
    probe = Probe()
    async with running(make_router(probe)) as (_, port):
        stream = await connect(port)
        await stream.send(request_bytes("GET", "/wait"))
        with anyio.fail_after(5):
            await probe.started.wait()
        reset(stream)
        await stream.aclose()
        with anyio.fail_after(2):
            await probe.finalized.wait()
    assert probe.reasons == ["client_gone"]


async def test_client_reset_mid_stream_ends_the_producer() -> None:
    probe = Probe()
    async with running(make_router(probe)) as (_, port):
        stream = await connect(port)
        await stream.send(request_bytes("GET", "/slow-events"))
        await stream.receive()
        reset(stream)
        await stream.aclose()
        with anyio.fail_after(2):
            await probe.finalized.wait()
    assert probe.reasons == ["client_gone"]


async def test_stalled_reader_is_cut_off_with_bounded_memory() -> None:
    probe = Probe()
    async with running(make_router(probe), send_timeout=0.3) as (_, port):
        stream = await connect(port)
        sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        sock.setsockopt(__import__("socket").SOL_SOCKET, __import__("socket").SO_RCVBUF, 65536)
        await stream.send(request_bytes("GET", "/firehose"))  # then never read
        start = time.monotonic()
        with anyio.fail_after(10):
            await probe.finalized.wait()
        elapsed = time.monotonic() - start
        await stream.aclose()
    assert probe.reasons == ["send_stall"]
    # Kernel buffers plus one asyncio high-water mark, never the producer's whole output.
    assert probe.produced * 65536 < 16 * 1024 * 1024, probe.produced
    assert elapsed < 5
