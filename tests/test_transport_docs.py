"""The examples in docs/transport.md run as written (with a probe inserted or a port
changed): the embedding example serves every kind of response and stops on a signal; the
small ``transport.run`` app drains on SIGTERM or SIGINT, in a process of its own, and a
second signal stops it at once (issue 53 point 7a)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect as ws_connect

from tests.scripted import ROOT, free_port
from wire.child import stop_process

DOC = Path(__file__).resolve().parent.parent / "docs" / "transport.md"
REPORT = b"GET /v1/report HTTP/1.1\r\nhost: t\r\n\r\n"


def doc_example(heading: str) -> str:
    """The first ``python`` block in the section of docs/transport.md under ``heading``."""
    text = DOC.read_text()
    start = text.index(f"\n## {heading}\n")
    code = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert code is not None, heading
    return code.group(1)


def _substitute(source: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert old in source, old
        source = source.replace(old, new)
    return source


@pytest.mark.timeout(30)
def test_embedding_example_serves_every_kind_of_response(
    capsys: pytest.CaptureFixture[str],
) -> None:
    source = _substitute(
        doc_example("Embedding it in an anyio app"),
        [
            ("port=8000", "port=0"),
            ('print("listening on", bound)', "await _probe(bound)"),
            ("anyio.run(main)", ""),
        ],
    )
    seen: dict[str, Any] = {}

    async def probe(bound: list[tuple[str, int]]) -> None:
        base = f"http://127.0.0.1:{bound[0][1]}"
        async with httpx.AsyncClient(base_url=base) as http:
            seen["model"] = (await http.get("/v1/models/smol")).json()
            seen["echo"] = (await http.post("/v1/echo", json={"a": 1})).json()
            async with http.stream("GET", "/v1/ticks") as r:
                seen["tick"] = await anext(r.aiter_lines())
        async with ws_connect(base.replace("http", "ws") + "/v1/ws") as ws:
            await ws.send("ping")
            seen["ws"] = await ws.recv()
        os.kill(os.getpid(), signal.SIGTERM)  # the example's signal receiver takes it

    namespace: dict[str, Any] = {"_probe": probe}
    exec(compile(source, str(DOC), "exec"), namespace)
    anyio.run(namespace["main"])
    assert seen == {
        "model": {"id": "smol"},
        "echo": {"got": {"a": 1}},
        "tick": 'data: {"tick": 0}',
        "ws": "ping",
    }
    assert "stream ended: client_gone" in capsys.readouterr().out


# ------------------------------------------------------------------ transport.run
def _start_small_app(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """docs/transport.md's small app, as written but for its port, in a process of its own."""
    port = free_port()
    script = tmp_path / "app.py"
    script.write_text(_substitute(doc_example("A small app: `transport.run`"), [
        ("port=8000", f"port={port}"),
    ]))  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, str(script)], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the app did not start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)


def _ask(port: int, request: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(request)
    return sock


def _answer(sock: socket.socket) -> bytes:
    """Every byte until the server closes (a reset raises: no test here expects one)."""
    data = b""
    with sock:
        while chunk := sock.recv(65536):
            data += chunk
    return data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_run_drains_on_a_signal_and_exits_zero(tmp_path: Path, signum: int) -> None:
    """The first signal: the request in flight (1 s of work) finishes with its answer
    and Connection: close, a new request meanwhile gets 503 + Retry-After, and the app
    exits 0 without a traceback, its last line printed."""
    proc, port = _start_small_app(tmp_path)
    try:
        in_flight = _ask(port, REPORT)
        time.sleep(0.3)
        proc.send_signal(signum)
        time.sleep(0.2)
        refused = _answer(_ask(port, REPORT))
        answered = _answer(in_flight)
        out, err = proc.communicate(timeout=15)
    finally:
        stop_process(proc)
    assert proc.returncode == 0, err
    assert answered.startswith(b"HTTP/1.1 200"), answered
    assert answered.endswith(b'{"report":"ready"}') and b"connection: close" in answered.lower()
    assert refused.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in refused, refused
    assert "Traceback" not in err and out == "stopped\n"
    assert f"{signal.Signals(signum).name}: draining" in err


@pytest.mark.timeout(60)
def test_a_second_signal_stops_run_at_once(tmp_path: Path) -> None:
    proc, port = _start_small_app(tmp_path)
    try:
        in_flight = _ask(port, REPORT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        time.sleep(0.1)
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=15)
        stopped_in = time.monotonic() - start
        answered = _answer(in_flight)
    finally:
        stop_process(proc)
    assert proc.returncode == 0 and "Traceback" not in err, err
    assert stopped_in < 0.5 and answered == b"", (stopped_in, answered)
    assert "SIGINT again: stopping now" in err and out == "stopped\n"
