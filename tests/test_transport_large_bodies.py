"""Large request bodies, one after another on a keep-alive connection.

Regression: the second request on a connection whose first one had a body over the fast
path's 64 KiB hung. The reader task, still reading for the connection, took the second
request's head and body as bytes pipelined behind the last response and waited for
room once they passed ``max_header_bytes``; the bytes then became the current request's
body, and nothing woke the reader to read the rest (found while bounding unknown body
fields, issue 54; every second 100 KB /generate on a keep-alive connection timed out)."""

from __future__ import annotations

import anyio
import pytest

from .transport_helpers import RawClient, connect, echo_router, request_bytes, running

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.parametrize("size", [70_000, 100_000, 1_000_000])
async def test_large_bodies_one_after_another_on_one_connection(size: int) -> None:
    async with running(echo_router()) as (_server, port):
        stream = await connect(port)
        client = RawClient(stream)
        for i in range(4):
            body = bytes([65 + i]) * size
            await client.send(request_bytes("POST", "/echo", body))
            with anyio.fail_after(10):
                response, got = await client.response(timeout=10)
            assert response.status_code == 200 and got == body, i
        await stream.aclose()


async def test_large_bodies_pipelined_on_one_connection() -> None:
    async with running(echo_router()) as (_server, port):
        stream = await connect(port)
        client = RawClient(stream)
        bodies = [bytes([65 + i]) * 100_000 for i in range(3)]
        await client.send(b"".join(request_bytes("POST", "/echo", b) for b in bodies))
        for body in bodies:
            response, got = await client.response(timeout=10)
            assert response.status_code == 200 and got == body
        await stream.aclose()
