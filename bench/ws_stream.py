"""Streaming cost, one WebSocket against SSE: server CPU per streamed token and wall time
for the same generations, with the scripted instant worker (so the frontend is measured).

SSE: ``--streams`` concurrent ``POST /generate`` streams (incremental), one connection
each. WebSocket: the same generations on one ``/v1/stream`` socket. The server's own CPU
time (children excluded) is read with psutil around each phase.

    python bench/ws_stream.py [--streams 32] [--tokens 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
from websockets.asyncio.client import connect

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.scripted import lifecycle_server  # noqa: E402
from tests.ws_helpers import server_process  # noqa: E402


def body(i: int, tokens: int) -> dict[str, Any]:
    return {"input_ids": [100 + i, 200 + i, 300 + i], "sampling_params": {"max_new_tokens": tokens}}


async def sse_round(url: str, streams: int, tokens: int) -> int:
    async def one(c: httpx.AsyncClient, i: int) -> int:
        got = 0
        payload = {**body(i, tokens), "stream": True, "incremental_streaming_output": True}
        async with c.stream("POST", "/generate", json=payload) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    got += len(json.loads(line[6:])["output_ids"])
        return got

    limits = httpx.Limits(max_connections=streams)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as c:
        return sum(await asyncio.gather(*(one(c, i) for i in range(streams))))


async def ws_round(url: str, streams: int, tokens: int) -> int:
    got, open_ids = 0, set(range(streams))
    async with connect(url.replace("http", "ws") + "/v1/stream", max_size=None) as ws:
        for i in range(streams):
            await ws.send(json.dumps({"type": "generate", "id": i, "body": body(i, tokens)}))
        while open_ids:
            msg = json.loads(await ws.recv())
            if msg["type"] == "delta":
                got += len(msg["output_ids"])
            else:
                open_ids.discard(msg["id"])
    return got


def measure(proc: psutil.Process, run: Any) -> tuple[float, float, int]:
    cpu0, t0 = proc.cpu_times(), time.perf_counter()
    tokens = asyncio.run(run)
    cpu1, wall = proc.cpu_times(), time.perf_counter() - t0
    return (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system), wall, tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    with lifecycle_server(
        "--scripted-worker", "--max-pending", "256", "--max-running", "256"
    ) as url:
        proc = server_process(url)
        asyncio.run(ws_round(url, 4, 16))  # warm both paths
        asyncio.run(sse_round(url, 4, 16))
        for name, fn in (("sse", sse_round), ("websocket", ws_round)):
            best = None
            for _ in range(a.rounds):
                cpu, wall, tokens = measure(proc, fn(url, a.streams, a.tokens))
                assert tokens == a.streams * a.tokens, tokens
                if best is None or cpu < best[0]:
                    best = (cpu, wall, tokens)
            cpu, wall, tokens = best  # type: ignore[misc]
            print(
                f"{name:9s} {a.streams} streams x {a.tokens} tokens: server CPU "
                f"{cpu * 1e6 / tokens:6.1f} us/token, wall {wall:5.2f} s, "
                f"{tokens / wall:8.0f} tokens/s"
            )


if __name__ == "__main__":
    main()
