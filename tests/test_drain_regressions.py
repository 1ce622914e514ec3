"""Drain regressions (issue 37 item 7 and the Retry-After part of item 11), against a real
``lifecycle serve`` process on the scripted worker, over real sockets."""

from __future__ import annotations

import json
import re
import signal
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from lifecycle.core.states import DRAIN
from tests.test_drain import LONG, _body, _serve, _stream
from tests.transport_helpers import read_until_closed
from wire.child import stop_process

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _post(body: bytes) -> bytes:
    head = b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


async def _sigterm_after_sending(sent: bytes, pause: float, traced: str | None = None) -> bytes:
    """A fresh server; ``sent`` written on one connection, SIGTERM ``pause`` s later (and
    once request ``traced`` is known to the server, however long that takes): every byte
    the connection then gets until the server closes it (the server exits)."""
    proc, url = _serve()
    try:
        async with await anyio.connect_tcp(*_host_port(url)) as sock:
            await sock.send(sent)
            await anyio.sleep(pause)
            async with httpx.AsyncClient(timeout=10) as c:
                with anyio.fail_after(30):
                    while traced and (await c.get(f"{url}/debug/requests/{traced}")).is_error:
                        await anyio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            data = await read_until_closed(sock, 10)
        await anyio.to_thread.run_sync(lambda: proc.wait(20))
    finally:
        stop_process(proc)
    return data


async def test_drain_answers_every_pipelined_request() -> None:
    """issue 37 item 7: three requests pipelined on one connection before SIGTERM get
    three answers (the first served, the rest 503), the last saying Connection: close;
    before, the two behind the first were dropped unanswered."""
    bodies = [json.dumps({**_body(i, 60, False), "rid": f"p{i}"}).encode() for i in range(3)]
    # the first is served (1.2 s) from before the signal: the rest wait behind it
    data = await _sigterm_after_sending(b"".join(_post(b) for b in bodies), 0.0, traced="p0")
    assert re.findall(rb"HTTP/1\.1 (\d{3}) ", data) == [b"200", b"503", b"503"], data
    assert data.lower().count(b"connection: close") == 1
    assert data.lower().count(f"retry-after: {DRAIN.refused.retry_after}".encode()) == 2


async def test_drain_answers_a_slow_upload_503() -> None:
    """issue 37 item 7: a request whose body is still uploading when the drain ends gets
    503 + Retry-After + Connection: close, not a reset (a broken pipe before)."""
    body = json.dumps(_body(1, 10, False)).encode()
    data = await _sigterm_after_sending(_post(body)[: -len(body) // 2], 0.3)
    head = data.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 503"), data
    assert f"retry-after: {DRAIN.refused.retry_after}".encode() in head
    assert b"connection: close" in head


async def _raw_refusal(url: str) -> bytes:
    """A fresh connection's whole answer while draining, read off the socket."""
    async with await anyio.connect_tcp(*_host_port(url)) as sock:
        await sock.send(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        return await read_until_closed(sock)


async def test_drain_503s_share_one_retry_after() -> None:
    """issue 37 item 11: every drain 503 carries the same Retry-After (the transport's
    refusal of a new connection said 1, the app's cut request said 5)."""
    proc, url = _serve()
    try:
        unary: dict[str, Any] = {}
        async with httpx.AsyncClient(timeout=30) as c, anyio.create_task_group() as tg:

            async def one_unary() -> None:
                r = await c.post(url + "/generate", json=_body(50, LONG, False))
                unary.update(status=r.status_code, headers=r.headers)

            tg.start_soon(one_unary)
            with anyio.fail_after(30):  # the unary one under way, then the signal
                while (await c.get(url + "/server_info")).json()["live_requests"] < 1:
                    await anyio.sleep(0.01)
            proc.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient(timeout=10) as fresh:  # the signal landed
                with anyio.fail_after(30):
                    while (await fresh.get(url + "/health")).status_code != 503:
                        await anyio.sleep(0.01)
            refusal = await _raw_refusal(url)
        await anyio.to_thread.run_sync(lambda: proc.wait(20))
    finally:
        stop_process(proc)
    head = refusal.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 503"), refusal
    want = str(DRAIN.refused.retry_after)
    assert f"retry-after: {want}\r\n".encode() in head + b"\r\n", head
    assert b"connection: close" in head
    assert unary["status"] == DRAIN.cut.status
    assert unary["headers"]["retry-after"] == want


async def test_drain_closes_websockets_1001_after_their_errors() -> None:
    """issue 37 item 7: at the drain cut a WebSocket with a generation running gets its
    error message, then a close frame with 1001 (going away); an idle one gets 1001 too.
    Before, both ended with no close frame (1006)."""
    proc, url = _serve()
    ws_url = url.replace("http", "ws") + "/v1/stream"
    got: dict[str, Any] = {}
    try:
        async with connect(ws_url) as busy, connect(ws_url) as idle:
            await busy.send(
                json.dumps({"type": "generate", "id": 1, "body": _body(9, LONG, False)})
            )
            await anyio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            messages = []
            with anyio.fail_after(15):
                try:
                    async for raw in busy:
                        messages.append(json.loads(raw))
                except ConnectionClosed:
                    pass
                await busy.wait_closed()
                await idle.wait_closed()
            got.update(messages=messages, busy=busy.close_code, idle=idle.close_code)
        await anyio.to_thread.run_sync(lambda: proc.wait(20))
    finally:
        stop_process(proc)
    last = got["messages"][-1]
    assert last["type"] == "error" and last["error"]["code"] == DRAIN.cut.status, last
    assert got["busy"] == 1001 and got["idle"] == 1001, got


async def test_second_sigterm_ends_streams_shutting_down() -> None:
    """issue 37 item 7: a second SIGTERM during the drain ends each live stream with an
    explicit shutting_down error event then [DONE]; before, the streams were cancelled
    and labelled internal ("handler ended early") with no event."""
    proc, url = _serve()
    out: dict[str, Any] = {}
    try:
        async with httpx.AsyncClient(timeout=30) as c, anyio.create_task_group() as tg:
            tg.start_soon(_stream, c, url, 3, LONG, out)
            with anyio.fail_after(20):
                while "started" not in out:
                    await anyio.sleep(0.01)
                await out["started"].wait()
            proc.send_signal(signal.SIGTERM)
            await anyio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
        await anyio.to_thread.run_sync(lambda: proc.wait(20))
    finally:
        stop_process(proc)
    assert out["done"], out["events"][-1:]
    last = out["events"][-1]
    assert last["error"]["type"] == DRAIN.cut.err_type, last
    assert last["error"]["code"] == DRAIN.cut.status
