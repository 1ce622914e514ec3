"""Requests/s for a small JSON POST: this transport vs uvicorn (h11 and httptools).

Each server runs in its own subprocess (pinned to CPU 0 when there are two or more),
serving the same handler: read a ~500-byte JSON body, parse it, answer ~500 bytes of
JSON. The load client is another process (pinned to CPU 1): asyncio streams on raw
sockets, keep-alive, one request in flight per connection, at 1 and 32 connections.

    python bench/transport.py            # the whole comparison, about a minute
    python bench/transport.py --seconds 2
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parent.parent
SERVERS = ("lifecycle", "bare-anyio-h11", "uvicorn-h11", "uvicorn-httptools")
PAYLOAD = {
    "model": "SmolLM2-135M-Instruct",
    "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
    "max_tokens": 16,
    "temperature": 0.7,
    "top_p": 0.95,
    "stream": False,
    "stop": ["\n\n", "###"],
    "user": "bench",
}
BODY = orjson.dumps(PAYLOAD)
REQUEST = (
    b"POST /v1/echo HTTP/1.1\r\nhost: 127.0.0.1\r\nuser-agent: bench/1\r\n"
    b"accept: application/json\r\ncontent-type: application/json\r\n"
    b"content-length: " + str(len(BODY)).encode() + b"\r\n\r\n" + BODY
)


def answer(payload: dict) -> bytes:
    """The shared handler logic: ~500 bytes of JSON derived from the request."""
    return orjson.dumps(
        {
            "id": "cmpl-bench",
            "object": "text_completion",
            "model": payload["model"],
            "choices": [{"index": 0, "text": payload["prompt"][:300], "finish_reason": "length"}],
            "usage": {"prompt_tokens": 90, "completion_tokens": 16, "total_tokens": 106},
        }
    )


def pin(cpu: int) -> None:
    if hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) >= 2:
        os.sched_setaffinity(0, {cpu})


def serve(kind: str, port: int) -> None:
    pin(0)
    if kind == "lifecycle":
        sys.path.insert(0, str(ROOT))
        from transport import Request, Response, Router, ServerConfig, run

        router = Router()

        @router.route("POST", "/v1/echo")
        async def echo(request: Request) -> Response:
            return Response(answer(await request.json()), content_type="application/json")

        run(router, ServerConfig(port=port))
        return
    if kind == "bare-anyio-h11":
        import anyio

        anyio.run(_bare_serve, port)
        return
    import uvicorn

    async def app(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
        if scope["type"] != "http":
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        data = answer(orjson.loads(body))
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": data})

    uvicorn.run(
        app,
        host="127.0.0.1",
        port=port,
        http=kind.split("-")[1],
        loop="asyncio",
        log_level="warning",
        access_log=False,
        lifespan="off",
    )


async def _bare_handle(stream) -> None:  # type: ignore[no-untyped-def]
    """The floor: one task per connection, h11, no limits, no disconnect watching."""
    import anyio
    import h11

    conn = h11.Connection(h11.SERVER)
    body = b""
    async with stream:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                try:
                    conn.receive_data(await stream.receive())
                except anyio.EndOfStream:
                    return
            elif type(event) is h11.Request:
                body = b""
            elif type(event) is h11.Data:
                body += event.data
            elif type(event) is h11.EndOfMessage:
                data = answer(orjson.loads(body))
                out = conn.send(
                    h11.Response(
                        status_code=200,
                        headers=[
                            ("content-type", "application/json"),
                            ("content-length", str(len(data))),
                        ],
                    )
                )
                out += conn.send(h11.Data(data=data)) + conn.send(h11.EndOfMessage())
                await stream.send(out)
                conn.start_next_cycle()
            else:
                return


async def _bare_serve(port: int) -> None:
    import anyio

    listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=port)
    await listener.serve(_bare_handle)


async def _connection(port: int, stop_at: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    n = 0
    try:
        while time.perf_counter() < stop_at:
            writer.write(REQUEST)
            head = await reader.readuntil(b"\r\n\r\n")
            start = head.lower().index(b"content-length:") + 15
            length = int(head[start : head.index(b"\r\n", start)])
            body = await reader.readexactly(length)
            if not head.startswith(b"HTTP/1.1 200") or not body.startswith(b"{"):
                raise RuntimeError(f"bad response: {head[:60]!r}")
            n += 1
    finally:
        counts.append(n)
        writer.close()


async def _load(port: int, conns: int, seconds: float) -> float:
    counts: list[int] = []
    stop_at = time.perf_counter() + seconds
    start = time.perf_counter()
    await asyncio.gather(*(_connection(port, stop_at, counts) for _ in range(conns)))
    return sum(counts) / (time.perf_counter() - start)


def load(port: int, conns: int, seconds: float) -> None:
    pin(1)
    asyncio.run(_load(port, conns, min(0.5, seconds)))  # warm-up
    print(f"{asyncio.run(_load(port, conns, seconds)):.0f}")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process: robust when other jobs share the cores."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("server did not start")


def compare(seconds: float) -> None:
    me = [sys.executable, __file__]
    results: dict[str, dict[int, float]] = {}
    cpu_us: dict[str, dict[int, float]] = {}
    for kind in SERVERS:
        port = _free_port()
        proc = subprocess.Popen([*me, "serve", kind, str(port)])
        try:
            _wait_ready(port, proc)
            results[kind], cpu_us[kind] = {}, {}
            for conns in (1, 32):
                cpu0 = _cpu_seconds(proc.pid)
                out = subprocess.run(
                    [*me, "load", str(port), str(conns), str(seconds)],
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout
                rate = float(out.strip().splitlines()[-1])
                served = rate * seconds + rate * min(0.5, seconds)  # measured + warm-up
                results[kind][conns] = rate
                cpu_us[kind][conns] = (_cpu_seconds(proc.pid) - cpu0) / served * 1e6
        finally:
            proc.terminate()
            proc.wait(10)
    print(f"\nsmall JSON POST ({len(REQUEST)} B request, keep-alive), requests/s:")
    print(f"{'server':<20}{'c=1':>10}{'c=32':>10}   server CPU us/request c=1, c=32")
    for kind, row in results.items():
        cpu = cpu_us[kind]
        print(f"{kind:<20}{row[1]:>10.0f}{row[32]:>10.0f}   {cpu[1]:>8.0f}{cpu[32]:>8.0f}")
    base = results["uvicorn-h11"]
    ours = results["lifecycle"]
    print(f"lifecycle / uvicorn-h11: c=1 {ours[1] / base[1]:.2f}x, c=32 {ours[32] / base[32]:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "serve", "load"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--seconds", type=float, default=4.0)
    ns = parser.parse_args()
    if ns.mode == "serve":
        serve(ns.args[0], int(ns.args[1]))
    elif ns.mode == "load":
        load(int(ns.args[0]), int(ns.args[1]), float(ns.args[2]))
    else:
        compare(ns.seconds)


if __name__ == "__main__":
    main()
