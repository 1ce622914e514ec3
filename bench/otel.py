"""What span export costs the frontend (``--otlp-traces-endpoint``, docs/tracing.md):
CPU per request with export off, on to a collector that is down, and (``--live``) on to
one that takes every span, in one run.

The servers (``lifecycle serve --scripted-worker``, as in ``bench/frontend.py``, whose
client this reuses) run side by side. Each round drives all of them at once with the same
load, so a busy machine slows them alike, and reads each server's CPU time (psutil,
children excluded) around it, the drives started in another order each round. A
variant's cost is the median over rounds of its CPU per request over export-off's in the
same round; ``--control`` runs a second export-off server to show what that figure is when
nothing differs.

    python bench/otel.py [--requests 2000] [--rounds 5] [--concurrency 32] [--live] [--control]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.frontend import _cpu, _free_port, serve  # noqa: E402

UNARY = {"sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@contextmanager
def _collector() -> Iterator[str]:
    """A collector that answers every POST with 200 (its CPU is this process's)."""

    class Sink(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["content-length"]))
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    sink = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{sink.server_address[1]}/v1/traces"
    finally:
        sink.shutdown()
        sink.server_close()


async def _drive(url: str, n: int, conc: int) -> None:
    """``n`` unary requests, ``conc`` at a time, each with the same ``traceparent``."""
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    headers = {"traceparent": TRACEPARENT}
    async with httpx.AsyncClient(timeout=120, limits=limits, headers=headers) as client:

        async def one(i: int) -> None:
            async with sem:
                body = {**UNARY, "input_ids": [100 + i % 1000, 7, 8, 9]}
                r = await client.post(url + "/generate", json=body)
                assert r.status_code == 200, r.text

        await asyncio.gather(*(one(i) for i in range(n)))


async def _round(urls: list[str], n: int, conc: int) -> None:
    await asyncio.gather(*(_drive(url, n, conc) for url in urls))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=2000, help="per server and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=32, help="per server")
    p.add_argument("--live", action="store_true", help="also export to a collector that is up")
    p.add_argument(
        "--control", action="store_true", help="a second export-off server: the noise floor"
    )
    args = p.parse_args()
    with ExitStack() as stack:
        variants: dict[str, tuple[str, ...]] = {
            "export off": (),
            "collector down": ("--otlp-traces-endpoint", f"http://127.0.0.1:{_free_port()}"),
        }
        if args.live:
            variants["collector up"] = ("--otlp-traces-endpoint", stack.enter_context(_collector()))
        if args.control:
            variants["export off again"] = ()
        servers = {
            name: stack.enter_context(serve(ROOT, extra)) for name, extra in variants.items()
        }
        urls = [url for _, url in servers.values()]
        asyncio.run(_round(urls, 100, args.concurrency))  # warm-up
        per_req: dict[str, list[float]] = {name: [] for name in servers}
        for r in range(args.rounds):
            before = {name: _cpu(proc) for name, (proc, _) in servers.items()}
            k = r % len(urls)  # each round starts its drives in another order
            asyncio.run(_round(urls[k:] + urls[:k], args.requests, args.concurrency))
            for name, (proc, _) in servers.items():
                per_req[name].append((_cpu(proc) - before[name]) / args.requests * 1e6)
    _report(per_req, args)
    return 0


def _report(per_req: dict[str, list[float]], args: argparse.Namespace) -> None:
    base = per_req["export off"]
    print(
        f"frontend CPU per request (unary, 1 token, traceparent sent), us; "
        f"{args.requests} requests per server and round, {args.rounds} rounds"
    )
    for name, values in per_req.items():
        rounds = "/".join(f"{v:.0f}" for v in values)
        line = f"  {name:<16}{statistics.median(values):8.0f}   ({rounds})"
        if values is not base:
            change = [(v - b) / b * 100 for v, b in zip(values, base, strict=True)]
            spread = "/".join(f"{c:+.1f}" for c in change)
            line += f"   vs export off: {statistics.median(change):+.1f}% ({spread})"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
