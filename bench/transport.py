"""Requests/s for a small JSON POST: this transport vs uvicorn (h11 and httptools).

Each server runs in its own subprocess (pinned to CPU 0 when there are two or more),
serving the same handler: read a ~500-byte JSON body, parse it, answer ~500 bytes of
JSON. The load client is another process (pinned to CPU 1): asyncio streams on raw
sockets, keep-alive, one request in flight per connection, at 1 and 32 connections.

    python bench/transport.py            # the whole comparison, under a minute
    python bench/transport.py --seconds 3 --rounds 5
    python bench/transport.py --against /path/to/other/checkout   # A/B two transports

With uvloop installed every server runs on it (``--loop uvloop``), uvicorn included.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import socket
import statistics
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


def serve(kind: str, port: int, loop: str, root: str = str(ROOT)) -> None:
    pin(0)
    if kind == "lifecycle":
        sys.path.insert(0, root)
        import anyio

        from transport import Request, Response, Router, Server, ServerConfig

        router = Router()

        @router.route("POST", "/v1/echo")
        async def echo(request: Request) -> Response:
            return Response(answer(await request.json()), content_type="application/json")

        server = Server(router, ServerConfig(port=port))
        anyio.run(server.serve, backend_options={"use_uvloop": loop == "uvloop"})
        return
    if kind == "bare-anyio-h11":
        import anyio

        anyio.run(_bare_serve, port, backend_options={"use_uvloop": loop == "uvloop"})
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
        loop=loop,
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


async def _load(port: int, conns: int, seconds: float) -> tuple[int, float]:
    counts: list[int] = []
    stop_at = time.perf_counter() + seconds
    start = time.perf_counter()
    await asyncio.gather(*(_connection(port, stop_at, counts) for _ in range(conns)))
    return sum(counts), time.perf_counter() - start


def load(port: int, conns: int, seconds: float) -> None:
    """Print the measured rate and how many requests were sent in all (warm-up included)."""
    pin(1)
    warm, _ = asyncio.run(_load(port, conns, min(0.5, seconds)))
    count, elapsed = asyncio.run(_load(port, conns, seconds))
    print(f"{count / elapsed:.0f} {warm + count}")


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


def _measure(
    proc: subprocess.Popen[bytes], port: int, conns: int, seconds: float
) -> tuple[float, float]:
    """(requests/s, server CPU µs per request) for one load run against one server."""
    cpu0 = _cpu_seconds(proc.pid)
    out = subprocess.run(
        [sys.executable, __file__, "load", str(port), str(conns), str(seconds)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    rate, sent = out.split()
    return float(rate), (_cpu_seconds(proc.pid) - cpu0) / int(sent) * 1e6


def compare(seconds: float, rounds: int, loop: str, against: str | None) -> None:
    """All servers up at once (idle ones cost nothing); rounds interleave them so that
    load from other jobs on the box falls on all of them alike; medians are reported."""
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    servers = {kind: [kind, str(ROOT)] for kind in SERVERS}
    if against is not None:
        servers["lifecycle@against"] = ["lifecycle", against]
    try:
        for name, (kind, root) in servers.items():
            port = _free_port()
            procs[name] = (
                subprocess.Popen([sys.executable, __file__, "serve", kind, str(port), loop, root]),
                port,
            )
        for proc, port in procs.values():
            _wait_ready(port, proc)
        for _ in range(rounds):
            for conns in (1, 32):
                for kind, (proc, port) in procs.items():
                    samples.setdefault((kind, conns), []).append(
                        _measure(proc, port, conns, seconds)
                    )
    finally:
        for proc, _ in procs.values():
            proc.terminate()
            proc.wait(10)
    rate = {k: statistics.median(r for r, _ in v) for k, v in samples.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in samples.items()}
    print(
        f"\nsmall JSON POST ({len(REQUEST)} B request, keep-alive), {loop} loop,"
        f" median of {rounds} rounds"
    )
    print(f"{'server':<20}{'req/s c=1':>11}{'c=32':>8}   server CPU µs/request c=1, c=32")
    for kind in servers:
        print(
            f"{kind:<20}{rate[kind, 1]:>11.0f}{rate[kind, 32]:>8.0f}"
            f"   {cpu[kind, 1]:>8.0f}{cpu[kind, 32]:>8.0f}"
        )
    for conns in (1, 32):
        print(
            f"lifecycle / uvicorn-h11 at c={conns}: "
            f"{rate['lifecycle', conns] / rate['uvicorn-h11', conns]:.2f}x req/s, "
            f"{cpu['uvicorn-h11', conns] / cpu['lifecycle', conns]:.2f}x CPU efficiency"
        )


def _default_loop() -> str:
    return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="compare", choices=["compare", "serve", "load"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--seconds", type=float, default=1.2, help="per load run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default=_default_loop())
    parser.add_argument("--against", help="another checkout whose transport runs beside ours")
    ns = parser.parse_args()
    if ns.mode == "serve":
        serve(ns.args[0], int(ns.args[1]), *ns.args[2:])
    elif ns.mode == "load":
        load(int(ns.args[0]), int(ns.args[1]), float(ns.args[2]))
    else:
        compare(ns.seconds, ns.rounds, ns.loop, ns.against)


if __name__ == "__main__":
    main()
