"""Graceful drain (``DRAIN`` in lifecycle/core/states.py, docs/lifecycle.md): SIGTERM during
32 live streams, a unary request and a WebSocket generation, against a real
``lifecycle serve`` process on the scripted worker.

Half the streams finish within the drain timeout and must deliver every token, a finish
reason and ``[DONE]``; the other half are cut at the timeout and must end with an error
event then ``[DONE]``. Meanwhile ``/health`` and new requests get 503 with Retry-After,
and the process exits 0 within the drain timeout.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
import httpx
import pytest
from websockets.asyncio.client import connect

from lifecycle.core.states import DRAIN
from tests.scripted import ROOT, free_port
from wire.child import stop_process

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

DRAIN_TIMEOUT = 4.0
STEP = 0.02  # seconds per scripted step: 4 s of drain is ~200 tokens
SHORT, LONG = 40, 5000  # tokens: the short ones end well inside the drain, the long never
STREAMS = 32


def _serve() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port), "--scripted-worker"]
    argv += [
        "--worker-args",
        f"--step-delay {STEP} --max-running 64 --max-pending 64 --kv-blocks 65536",
    ]
    argv += ["--drain-timeout", str(DRAIN_TIMEOUT), "--log-level", "warning"]
    proc = subprocess.Popen(argv, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.05)


def _body(i: int, max_new: int, stream: bool) -> dict[str, Any]:
    return {
        "input_ids": [100 + i, 7, 8],
        "stream": stream,
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
    }


async def _stream(c: httpx.AsyncClient, url: str, i: int, max_new: int, out: dict) -> None:
    out.update(events=[], done=False, started=anyio.Event())
    async with c.stream("POST", url + "/generate", json=_body(i, max_new, True)) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            out["events"].append(json.loads(line[6:]))
            out["started"].set()


async def _websocket(url: str, out: dict) -> None:
    out.update(messages=[], started=anyio.Event())
    async with connect(url.replace("http", "ws") + "/v1/stream") as ws:
        await ws.send(json.dumps({"type": "generate", "id": 1, "body": _body(99, LONG, False)}))
        async for raw in ws:
            msg = json.loads(raw)
            out["messages"].append(msg)
            out["started"].set()
            if msg["type"] in ("done", "error"):
                return


async def test_sigterm_drains_streams_then_exits_zero() -> None:
    proc, url = _serve()
    try:
        outs = [dict() for _ in range(STREAMS)]
        unary: dict[str, Any] = {}
        ws: dict[str, Any] = {}
        limits = httpx.Limits(max_connections=64)
        async with (
            httpx.AsyncClient(timeout=60, limits=limits) as c,
            anyio.create_task_group() as tg,
        ):
            for i, out in enumerate(outs):
                tg.start_soon(_stream, c, url, i, SHORT if i % 2 else LONG, out)
            tg.start_soon(_websocket, url, ws)

            async def one_unary() -> None:
                r = await c.post(url + "/generate", json=_body(50, LONG, False))
                unary.update(status=r.status_code, body=r.json(), headers=r.headers)

            tg.start_soon(one_unary)
            with anyio.fail_after(30):
                while not all("started" in o for o in (*outs, ws)):
                    await anyio.sleep(0.01)
                for o in (*outs, ws):
                    await o["started"].wait()
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            async with httpx.AsyncClient(timeout=10) as fresh:
                with anyio.fail_after(DRAIN_TIMEOUT / 2):  # however late the signal lands
                    while (health := await fresh.get(url + "/health")).status_code == 200:
                        await anyio.sleep(0.01)
                refused = await fresh.post(url + "/generate", json=_body(1, 1, False))
            assert health.status_code == DRAIN.health_status
            assert refused.status_code == 503 and "retry-after" in refused.headers
            assert "error" in refused.json()
        exit_code = await anyio.to_thread.run_sync(lambda: proc.wait(DRAIN_TIMEOUT + 10))
        elapsed = time.monotonic() - t0
    finally:
        stop_process(proc)
    assert exit_code == DRAIN.exit_code
    assert elapsed < DRAIN_TIMEOUT + 3, f"exited {elapsed:.1f}s after SIGTERM"
    for i, out in enumerate(outs):
        assert out["done"], f"stream {i} was cut without [DONE]: {out['events'][-1:]}"
        last = out["events"][-1]
        if i % 2:  # short: all of it, with its finish reason
            assert last["meta_info"]["finish_reason"] == {"type": "length", "length": SHORT}
            assert len(last["output_ids"]) == SHORT
        else:  # long: cut at the timeout with an explicit error event
            assert last["error"]["type"] == DRAIN.cut.err_type, last
            assert last["error"]["code"] == DRAIN.cut.status
    assert unary["status"] == DRAIN.cut.status and "retry-after" in unary["headers"]
    assert "shutting down" in unary["body"]["error"]["message"]
    final = ws["messages"][-1]
    assert final["type"] == "error" and final["error"]["code"] == DRAIN.cut.status
