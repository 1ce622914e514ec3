"""Drain regressions (issue 37 item 7 and the Retry-After part of item 11), against a real
``lifecycle serve`` process on the scripted worker, over real sockets."""

from __future__ import annotations

import signal
from typing import Any

import anyio
import httpx
import pytest

from lifecycle.core.child import stop_process
from lifecycle.core.states import DRAIN
from tests.test_drain import LONG, _body, _serve

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def _raw_refusal(url: str) -> bytes:
    """A fresh connection's whole answer while draining, read off the socket."""
    host, port = url.removeprefix("http://").split(":")
    async with await anyio.connect_tcp(host, int(port)) as sock:
        await sock.send(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        data = b""
        with anyio.fail_after(5):
            try:
                while chunk := await sock.receive():
                    data += chunk
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass
    return data


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
            await anyio.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            await anyio.sleep(0.3)
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
