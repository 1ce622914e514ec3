"""Server lifecycle: graceful drain, the drain deadline, embedding next to other tasks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import anyio
import httpx
import pytest

from transport import Request, Response, Router, Server, ServerConfig, SSEResponse

from .transport_helpers import RawClient, connect, request_bytes

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def make_router(reasons: list[str | None], events: int | None) -> Router:
    router = Router()

    @router.route("GET", "/events")
    async def stream(request: Request) -> Response:
        async def gen() -> AsyncIterator[str]:
            try:
                i = 0
                while events is None or i < events:
                    yield str(i)
                    i += 1
                    await anyio.sleep(0.05)
            finally:
                reasons.append(request.disconnect_reason)

        return SSEResponse(gen())

    @router.route("GET", "/ok")
    async def ok(request: Request) -> Response:
        return Response(b"ok")

    return router


async def test_graceful_drain_lets_an_in_flight_stream_finish() -> None:
    reasons: list[str | None] = []
    server = Server(make_router(reasons, events=10), ServerConfig(port=0))
    async with anyio.create_task_group() as tg:
        port = (await tg.start(server.serve))[0][1]
        idle = await connect(port)  # an idle connection closes after drain_idle_timeout
        async with httpx.AsyncClient() as http:
            async with http.stream("GET", f"http://127.0.0.1:{port}/events") as r:
                lines = r.aiter_lines()
                assert await anext(lines) == "data: 0"
                tg.start_soon(server.shutdown)
                body = "data: 0\n" + "\n".join([line async for line in lines])
        assert body.count("data: ") == 10 and body.rstrip().endswith("data: 9")
        assert await RawClient(idle).closed(timeout=2)
        await idle.aclose()
    assert reasons == [None]
    with pytest.raises(OSError):
        await connect(port)


async def test_drain_deadline_cancels_what_is_left() -> None:
    reasons: list[str | None] = []
    server = Server(make_router(reasons, events=None), ServerConfig(port=0, shutdown_timeout=0.3))
    async with anyio.create_task_group() as tg:
        port = (await tg.start(server.serve))[0][1]
        stream = await connect(port)
        await stream.send(request_bytes("GET", "/events"))
        await stream.receive()
        start = time.monotonic()
        await server.shutdown()
        elapsed = time.monotonic() - start
        await stream.aclose()
    assert reasons == ["shutdown"] and 0.25 < elapsed < 2.0


async def test_embedded_next_to_other_tasks_and_cancelled_with_them() -> None:
    ticks = 0

    async def other_work() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.01)

    async with anyio.create_task_group() as tg:
        tg.start_soon(other_work)
        server = Server(make_router([], events=1), ServerConfig(port=0))
        port = (await tg.start(server.serve))[0][1]
        async with httpx.AsyncClient() as http:
            for _ in range(3):
                assert (await http.get(f"http://127.0.0.1:{port}/ok")).text == "ok"
        tg.cancel_scope.cancel()  # the app's own shutdown takes the server with it
    assert ticks > 0
