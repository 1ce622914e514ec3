"""``Request.respond``: a handler that sends its stream from inside its own scope, over
real sockets. The regression: cleanup in a producer's ``finally`` never ran when the
client left before the response head (a generator that never started is not run by
``aclose``); cleanup in the handler's scope runs on every exit."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest

from tests.transport_helpers import connect, read_until_closed, request_bytes, reset, running
from transport import Request, Response, SSEResponse

pytestmark = pytest.mark.anyio


class Owner:
    """What a handler owns for one request: entered before anything can fail."""

    def __init__(self) -> None:
        self.exits: list[str] = []
        self.exited = anyio.Event()
        self.producer_started = False

    def app(self, hold: float = 0.0):  # noqa: ANN201
        async def handler(request: Request) -> Response:
            try:
                request.on_disconnect(lambda: None)  # watch the client meanwhile
                await anyio.sleep(hold)  # e.g. admission and tokenization
                return await request.respond(SSEResponse(self.events()))
            finally:
                self.exits.append("gone" if request.is_disconnected() else "ended")
                self.exited.set()

        return handler

    async def events(self) -> AsyncIterator[bytes]:
        self.producer_started = True
        for i in range(3):
            yield b"%d" % i
        yield b"[DONE]"


async def test_a_stream_sent_from_the_handler_is_written_whole_and_kept_alive() -> None:
    owner = Owner()
    async with running(owner.app()) as (_server, port):
        stream = await connect(port)
        await stream.send(request_bytes("GET", "/") + request_bytes("GET", "/", connection="close"))
        data = await read_until_closed(stream)
        await stream.aclose()
    assert data.count(b"HTTP/1.1 200 ") == 2 and data.count(b"data: [DONE]\n\n") == 2
    assert data.endswith(b"0\r\n\r\n")  # both chunked bodies ended properly
    assert owner.exits == ["ended", "ended"]


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_the_owner_scope_exits_when_the_client_leaves_before_the_head(how: str) -> None:
    owner = Owner()
    async with running(owner.app(hold=0.2)) as (_server, port):
        stream = await connect(port)
        await stream.send(request_bytes("GET", "/"))
        if how == "rst":
            reset(stream)
        await stream.aclose()
        with anyio.fail_after(5):
            await owner.exited.wait()
    assert owner.exits == ["gone"]
    assert not owner.producer_started  # never pulled: no head, no events, still released


async def test_responding_twice_is_refused() -> None:
    errors: list[str] = []

    async def handler(request: Request) -> Response:
        sent = await request.respond(Response(b"one"))
        try:
            await request.respond(Response(b"two"))
        except RuntimeError as exc:
            errors.append(str(exc))
        return sent

    async with running(handler) as (_server, port):
        stream = await connect(port)
        await stream.send(request_bytes("GET", "/", connection="close"))
        data = await read_until_closed(stream)
        await stream.aclose()
    assert data.count(b"HTTP/1.1 200 ") == 1 and data.endswith(b"one")
    assert errors and "already answered" in errors[0]
