"""The access log (``--access-log``): one line per finished request, over a real server on
the scripted worker: unary, stream, WebSocket, 400, 503 and a client that left."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets

from .app_helpers import running_app
from .ws_helpers import echo_body, gen_msg


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the websockets client is asyncio-only


STEP = ("--step-delay", "0.01")


def _lines(path: Path, n: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(lines) >= n or time.monotonic() > deadline:
            return lines
        time.sleep(0.02)


@pytest.mark.anyio
async def test_one_line_per_request_with_how_it_ended(tmp_path: Path) -> None:
    log = tmp_path / "access.jsonl"
    async with running_app(worker_extra_args=STEP, access_log=str(log)) as app:
        base = f"http://127.0.0.1:{app.port}"
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            r = await c.post("/generate", json={**echo_body(1, 5), "rid": "unary-1"})
            assert r.status_code == 200
            async with c.stream(
                "POST", "/generate", json={**echo_body(2, 4), "stream": True, "rid": "stream-1"}
            ) as s:
                assert s.status_code == 200
                _ = [line async for line in s.aiter_lines()]  # fmt: skip
            r = await c.post("/generate", json={"text": "x", "sampling_params": {"top_p": 9}})
            assert r.status_code == 400
            with pytest.raises(httpx.ReadTimeout):  # the client leaves mid-generation
                await c.post("/generate",
                             json={**echo_body(3, 5000), "rid": "gone-1"}, timeout=0.3)  # fmt: skip
        async with websockets.connect(f"ws://127.0.0.1:{app.port}/v1/stream") as ws:
            await ws.send(gen_msg("g1", {**echo_body(4, 3), "rid": "ws-1"}))
            while json.loads(await ws.recv())["type"] != "done":
                pass
        app.frontend.begin_drain()  # from now on: 503
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            r = await c.post("/generate", json={**echo_body(5, 2), "rid": "late-1"})
            assert r.status_code == 503
        by_rid: dict[str, dict[str, Any]] = {}
        lines = _lines(log, 6)
        for line in lines:
            by_rid[str(line.get("rid"))] = line
    unary = by_rid["unary-1"]
    assert unary["status"] == 200 and unary["outcome"] == "done" and unary["route"] == "/generate"
    assert (unary["prompt_tokens"], unary["output_tokens"], unary["cached_tokens"]) == (3, 5, 0)
    assert unary["ttft_ms"] > 0 and unary["total_ms"] >= unary["ttft_ms"]
    assert unary["client"].startswith("127.0.0.1:") and unary["method"] == "POST"
    assert "prompt" not in unary  # never the prompt unless --log-requests
    stream = by_rid["stream-1"]
    assert (stream["status"], stream["outcome"], stream["output_tokens"]) == (200, "done", 4)
    bad = [x for x in lines if x["status"] == 400]
    assert len(bad) == 1 and bad[0]["route"] == "/generate"
    # A refused request is still a request: its id, how it ended (tests/test_rejected_traces)
    assert bad[0]["outcome"] == "invalid" and bad[0]["rid"] == bad[0]["request_id"]
    gone = by_rid["gone-1"]
    assert gone["outcome"] == "client_gone" and gone["status"] == 499
    ws = by_rid["ws-1"]
    assert ws["route"] == "/v1/stream" and ws["outcome"] == "done" and ws["output_tokens"] == 3
    assert ws["status"] == 101
    late = by_rid["late-1"]
    assert late["status"] == 503 and late["outcome"] == "shutting_down"


@pytest.mark.anyio
async def test_common_format_and_the_prompt_on_request(tmp_path: Path) -> None:
    log = tmp_path / "access.log"
    async with running_app(
        worker_extra_args=STEP, access_log=str(log), access_log_format="common"
    ) as app:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}") as c:
            await c.post("/generate", json={**echo_body(1, 2), "rid": "c-1"})
            await c.get("/health")
    text = log.read_text().splitlines()
    gen = next(line for line in text if "rid=c-1" in line)
    assert gen.startswith("127.0.0.1 - - [") and '"POST /generate HTTP/1.1" 200 -' in gen
    assert "outcome=done" in gen and "output_tokens=2" in gen
    assert any('"GET /health HTTP/1.1" 200' in line for line in text)
    log2 = tmp_path / "with-prompts.jsonl"
    async with running_app(worker_extra_args=STEP, access_log=str(log2), log_requests=True) as app:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.port}") as c:
            await c.post("/generate", json={"text": "secret words", "rid": "p-1",
                                             "sampling_params": {"max_new_tokens": 1}})  # fmt: skip
    line = next(x for x in _lines(log2, 1) if x.get("rid") == "p-1")
    assert line["prompt"] == ["secret words"]
