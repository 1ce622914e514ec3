"""SIGTERM under mixed traffic answers every request the server read (issue 53 point 3),
against a real ``lifecycle serve`` process on the scripted worker, over real sockets.

Keep-alive, pipelining and slow-uploading clients send ``/generate`` requests while a
short and a long stream run; SIGTERM comes mid-traffic. Every request a client sent
before the answer that said ``Connection: close`` gets an HTTP answer (200, or 503 with
Retry-After), no connection ends in a reset or an unparsable answer, a new connection
meanwhile gets 503, and the drain's last log line says what finished and what was cut.
Before: 16 of ~1,700 requests met a reset, 3 a protocol error, pipelined requests went
unanswered with no ``Connection: close``, and a slow upload met a broken pipe.
"""

from __future__ import annotations

import json
import logging
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import anyio.abc
import h11
import httpx
import pytest

from lifecycle.app import App
from lifecycle.core.states import DRAIN
from tests.scripted import ROOT, free_port
from tests.test_drain import LONG, SHORT, _body, _stream
from wire.child import stop_process

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

DRAIN_TIMEOUT = 4.0
KEEPALIVE, PIPELINED, UPLOADS = 8, 3, 3  # clients of each kind
BATCH = 3  # requests a pipelining client sends at once
TRAFFIC_S = 1.5  # of traffic before SIGTERM


class Reset(Exception):
    """The connection ended in a reset (ECONNRESET or EPIPE)."""


@dataclass
class Tally:
    """What the clients saw, over every connection."""

    sent: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    unanswered: int = 0  # sent before any Connection: close answer, yet no answer came
    resets: int = 0
    protocol_errors: int = 0
    retry_after_missing: int = 0
    probes: Counter[str] = field(default_factory=Counter)  # new connections in the drain

    def answered(self) -> int:
        return sum(self.statuses.values())


def _post(body: bytes) -> bytes:
    head = b"POST /generate HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


def _unary(i: int) -> bytes:
    return _post(json.dumps(_body(i % 100, 2, False)).encode())  # ids the worker knows


class Answers:
    """Reads one connection's answers in order, each framed by a fresh h11 client."""

    def __init__(self, sock: anyio.abc.SocketStream) -> None:
        self.sock = sock
        self.buf = b""

    async def _more(self) -> bytes:
        try:
            return await self.sock.receive()
        except anyio.EndOfStream:
            return b""
        except (anyio.BrokenResourceError, OSError) as exc:
            raise Reset from exc

    async def next(self) -> tuple[int, dict[str, str]] | None:
        """The next answer's status and headers; None on a clean close before it began.
        Raises Reset, or h11.RemoteProtocolError for bytes that are not an answer."""
        conn = h11.Connection(h11.CLIENT)
        conn.send(h11.Request(method="POST", target="/", headers=[("host", "t")]))
        conn.send(h11.EndOfMessage())
        if self.buf:  # (b"" would tell h11 the connection ended)
            conn.receive_data(self.buf)
            self.buf = b""
        answer: tuple[int, dict[str, str]] | None = None
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                data = await self._more()
                if not data and answer is None and not conn.trailing_data[0]:
                    return None  # closed where the next answer would have begun
                if not data:
                    raise h11.RemoteProtocolError("the answer was cut short")
                conn.receive_data(data)
            elif isinstance(event, h11.Response):
                answer = (event.status_code, {k.decode(): v.decode() for k, v in event.headers})
            elif isinstance(event, h11.EndOfMessage):
                self.buf = conn.trailing_data[0]
                assert answer is not None
                return answer

    async def end(self) -> None:
        """After a Connection: close answer: the rest must be a clean close."""
        while await self._more():
            pass


async def _connection(
    port: int,
    tally: Tally,
    batches: list[bytes],
    counts: list[int],
    think: random.Random | None = None,
    pause: float = 0.0,
) -> bool:
    """Send ``batches`` on one connection (``counts[i]`` requests in batch i), reading the
    answers to each batch before the next, ``think`` s apart (idle keep-alive between);
    True once an answer said Connection: close."""
    async with await anyio.connect_tcp("127.0.0.1", port) as sock:
        answers = Answers(sock)
        try:
            for batch, count in zip(batches, counts, strict=True):
                await _send(sock, batch, pause)
                tally.sent += count
                for n in range(count):
                    answer = await answers.next()
                    if answer is None:
                        tally.unanswered += count - n
                        return True
                    status, headers = answer
                    tally.statuses[status] += 1
                    if status == 503 and "retry-after" not in headers:
                        tally.retry_after_missing += 1
                    if headers.get("connection") == "close":
                        await answers.end()
                        return True
                if think is not None:
                    await anyio.sleep(think.uniform(0, 0.03))
        except Reset:
            tally.resets += 1
            return True
        except h11.RemoteProtocolError:
            tally.protocol_errors += 1
            return True
    return False


async def _send(sock: anyio.abc.SocketStream, data: bytes, pause: float) -> None:
    """All of ``data`` at once, or in 10 pieces ``pause`` s apart (a slow upload)."""
    if not pause:
        await sock.send(data)
        return
    step = -(-len(data) // 10)
    for i in range(0, len(data), step):
        await sock.send(data[i : i + step])
        await anyio.sleep(pause)


async def _client(port: int, tally: Tally, kind: str, seed: int, probe: bool) -> None:
    """Keep one connection busy until an answer says close; then, with ``probe``, one new
    connection, which the drain must answer 503."""
    i, think = seed * 1000, random.Random(seed)
    while True:
        i += 1
        if kind == "keepalive":
            closed = await _connection(port, tally, [_unary(i)] * 50, [1] * 50, think)
        elif kind == "pipelined":
            batch = b"".join(_unary(i + k) for k in range(BATCH))
            closed = await _connection(port, tally, [batch] * 20, [BATCH] * 20, think)
        else:  # a slow upload: ~2 KB of body over 4 s, one request a connection
            body = json.dumps(_body(i % 100, 2, False)).encode() + b" " * 2000
            closed = await _connection(port, tally, [_post(body)], [1], pause=0.4)
        if closed:
            break
    if probe:
        async with await anyio.connect_tcp("127.0.0.1", port) as sock:
            await sock.send(_unary(0))
            reply = await Answers(sock).next()
            tally.probes[str(reply[0] if reply else "closed")] += 1


def _serve(log: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port), "--scripted-worker"]
    argv += ["--worker-args", "--step-delay 0.02 --max-running 64 --max-pending 256"]
    argv += ["--drain-timeout", str(DRAIN_TIMEOUT), "--log-level", "info"]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stderr=out)
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.TransportError:
            pass
        time.sleep(0.05)


@pytest.mark.parametrize("streams", [True, False], ids=["cut", "quick"])
async def test_sigterm_under_mixed_traffic_answers_every_request_read(
    tmp_path: Path, streams: bool
) -> None:
    """``cut``: a long stream holds the drain to its deadline (and is cut there), a short
    one finishes in it, a new connection meanwhile gets 503. ``quick``: no stream, so
    the drain ends once the unary requests in flight have, and the server's shutdown
    deadline comes while the slow uploads still send their bodies."""
    log = tmp_path / "server.log"
    proc, port = _serve(log)
    tally = Tally()
    short: dict[str, Any] = {}
    long: dict[str, Any] = {}
    url = f"http://127.0.0.1:{port}"
    kinds = ["keepalive"] * KEEPALIVE + ["pipelined"] * PIPELINED + ["upload"] * UPLOADS
    try:
        async with httpx.AsyncClient(timeout=30) as c, anyio.create_task_group() as tg:
            for seed, kind in enumerate(kinds, 1):
                tg.start_soon(_client, port, tally, kind, seed, streams)
            if streams:
                tg.start_soon(_stream, c, url, 1, LONG, long)
                await anyio.sleep(TRAFFIC_S - SHORT * 0.02 / 2)
                tg.start_soon(_stream, c, url, 2, SHORT, short)
                with anyio.fail_after(20):
                    while "started" not in short:
                        await anyio.sleep(0.01)
                    await short["started"].wait()
            else:
                await anyio.sleep(TRAFFIC_S)
            before = tally.sent
            proc.send_signal(signal.SIGTERM)
        exit_code = await anyio.to_thread.run_sync(lambda: proc.wait(DRAIN_TIMEOUT + 10))
    finally:
        stop_process(proc)
    err = log.read_text()
    print(f"before SIGTERM {before} sent; in all {tally}")
    assert exit_code == DRAIN.exit_code and "Traceback" not in err, err[-3000:]
    assert tally.resets == 0 and tally.protocol_errors == 0, tally
    assert tally.unanswered == 0 and tally.answered() == tally.sent, tally
    assert set(tally.statuses) == {200, 503} and tally.retry_after_missing == 0, tally
    assert before > 50, "too little traffic to mean anything"
    stopped = re.search(r"stopped: (\d+) finished, (\d+) cut in (\d+\.\d)s", err)
    assert stopped is not None, err[-3000:]
    finished, cut, took = int(stopped[1]), int(stopped[2]), float(stopped[3])
    if streams:
        assert tally.probes == Counter({"503": len(kinds)}), tally
        assert short["done"] and "finish_reason" in short["events"][-1]["meta_info"]
        assert long["done"] and long["events"][-1]["error"]["code"] == DRAIN.cut.status
        assert cut == 1 and finished >= 1, stopped[0]  # the long one; the short one and more
        assert DRAIN_TIMEOUT - 1 < took < DRAIN_TIMEOUT + 1, stopped[0]
    else:  # the uploads past the shutdown deadline are read to their end (~2.5 s)
        assert cut == 0 and took < DRAIN_TIMEOUT, stopped[0]


class _Calls:
    """Live calls of which ``finishing`` end within the drain; the rest wait to be cut."""

    def __init__(self, live: int, finishing: int) -> None:
        self.live, self.finishing = live, finishing

    def __len__(self) -> int:
        return self.live

    async def wait_drained(self, timeout: float) -> bool:
        self.live -= self.finishing
        self.finishing = 0
        return self.live == 0

    def cut_all(self, cause: object, message: str) -> int:
        cut, self.live = self.live, 0
        return cut


class _Server:
    def begin_drain(self, retry_after: int | None = None) -> None:
        pass

    async def shutdown(self, timeout: float | None = None) -> None:
        pass


@pytest.mark.parametrize(("live", "finishing"), [(5, 3), (4, 4), (0, 0)])
async def test_drain_logs_what_finished_and_what_was_cut(
    caplog: pytest.LogCaptureFixture, live: int, finishing: int
) -> None:
    calls = _Calls(live, finishing)
    frontend = SimpleNamespace(calls=calls, begin_drain=lambda: None)
    config = SimpleNamespace(drain_timeout=10.0)
    app = App(config, _Server(), None, frontend, None, None)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO, logger="lifecycle.app"):
        assert await app.drain() == live - finishing
    assert caplog.messages[-1] == f"stopped: {finishing} finished, {live - finishing} cut in 0.0s"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
