"""Frontend cost with the scripted instant worker: CPU per request, per streamed token,
requests/s, and the state machine's share, in one run.

The server (``lifecycle serve --scripted-worker``) runs as its own process; its CPU time
(children excluded) is read with psutil around each phase, so the client's own cost is
not counted. The worker answers every step at once, so what is measured is the frontend.

    python bench/frontend.py [--requests 400] [--concurrency 32] [--tokens 64]
    python bench/frontend.py --baseline 46c348b   # side by side, A B A B, medians

Each cell is the median over the rounds, with every round's figure after it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


async def _drive(url: str, n: int, conc: int, body: dict, stream: bool) -> float:
    sem = asyncio.Semaphore(conc)
    limits = httpx.Limits(max_connections=conc, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int) -> None:
            async with sem:
                b = {**body, "input_ids": [100 + i % 1000, 7, 8, 9]}
                if stream:
                    async with client.stream("POST", url + "/generate", json=b) as r:
                        async for _ in r.aiter_bytes():
                            pass
                        assert r.status_code == 200
                else:
                    r = await client.post(url + "/generate", json=b)
                    assert r.status_code == 200, r.text

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0


def _phase(
    proc: psutil.Process, url: str, n: int, conc: int, body: dict, stream: bool
) -> tuple[float, float]:
    c0 = _cpu(proc)
    wall = asyncio.run(_drive(url, n, conc, body, stream))
    return _cpu(proc) - c0, wall


def _fsm_us(rounds: int = 20000) -> float:
    from lifecycle.core.buffers import AdmissionQueue
    from lifecycle.core.fsm import admit, new_request
    from lifecycle.core.registry import Registry
    from lifecycle.core.states import Event

    reg, q = Registry(), AdmissionQueue(10)
    t0 = time.perf_counter()
    for _ in range(rounds):
        rec = new_request(None)
        reg.add(rec)
        rec.fire(Event.VALIDATE)
        admit(rec, q)
        rec.fire(Event.DISPATCH)
        q.release()
        rec.fire(Event.FIRST_TOKEN)
        rec.fire(Event.FINISH)
        reg.remove(rec)
    return (time.perf_counter() - t0) / rounds * 1e6


@contextmanager
def serve(root: Path, extra: tuple[str, ...] = ()) -> Iterator[tuple[psutil.Process, str]]:
    """``lifecycle serve --scripted-worker`` from the tree at ``root`` (plus ``extra``
    flags), ready; yields its process and base URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "lifecycle", "serve", "--scripted-worker", "--port", str(port)]
    server = subprocess.Popen(
        [*argv, "--log-level", "warning", *extra],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("server did not become ready")
            time.sleep(0.1)
        yield psutil.Process(server.pid), url
    finally:
        server.terminate()
        server.wait(60)


def _measure(root: Path, args: argparse.Namespace) -> dict[str, float]:
    """One server from the tree at ``root``: CPU per request and per streamed token."""
    with serve(root) as (proc, url):
        unary = {"sampling_params": {"max_new_tokens": 1, "ignore_eos": True}}
        _phase(proc, url, 50, args.concurrency, unary, False)  # warm-up
        cpu_u, wall_u = _phase(proc, url, args.requests, args.concurrency, unary, False)
        streamed = {
            "stream": True,
            "sampling_params": {"max_new_tokens": args.tokens, "ignore_eos": True},
        }
        n_s = max(1, args.requests // 4)
        cpu_s, wall_s = _phase(proc, url, n_s, args.concurrency, streamed, True)
    per_req_us = cpu_u / args.requests * 1e6
    return {
        "req_us": per_req_us,
        "tok_us": max(0.0, cpu_s / n_s * 1e6 - per_req_us) / args.tokens,
        "rps": args.requests / wall_u,
        "tps": n_s * args.tokens / wall_s,
    }


def _checkout(ref: str, into: Path) -> Path:
    """The tree of commit ``ref`` (git archive), to serve the baseline from."""
    archive = subprocess.run(
        ["git", "archive", ref], cwd=ROOT, check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument(
        "--baseline",
        default=None,
        help="a git ref to measure side by side (A B A B), e.g. the commit before a change",
    )
    p.add_argument("--reps", type=int, default=2, help="A B rounds when --baseline is given")
    args = p.parse_args()
    if args.baseline is None:
        results = {"this tree": [_measure(ROOT, args)]}
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="lc-baseline-") as tmp:
            base = _checkout(args.baseline, Path(tmp))
            results = {"this tree": [], f"baseline {args.baseline}": []}
            for _ in range(args.reps):
                results["this tree"].append(_measure(ROOT, args))
                results[f"baseline {args.baseline}"].append(_measure(base, args))
    _report(results, args)
    return 0


def _report(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    import statistics

    rows = [
        ("frontend CPU per request (unary, 1 token), us", "req_us", "{:.0f}"),
        ("frontend CPU per streamed token (beyond req), us", "tok_us", "{:.1f}"),
        (f"requests/s (unary, concurrency {args.concurrency})", "rps", "{:.0f}"),
        (f"streamed tokens/s ({args.tokens}-token streams)", "tps", "{:.0f}"),
    ]
    names = list(results)
    print("figure".ljust(52) + "".join(n.rjust(28) for n in names))
    for label, key, fmt in rows:
        cells = []
        for n in names:
            values = [r[key] for r in results[n]]
            med = fmt.format(statistics.median(values))
            spread = "/".join(fmt.format(v) for v in values)
            cells.append(f"{med} ({spread})".rjust(28))
        print(label.ljust(52) + "".join(cells))
    per_req = statistics.median(r["req_us"] for r in results["this tree"])
    fsm = _fsm_us()
    print(
        f"state machine per request lifecycle: {fsm:.1f} us "
        f"({fsm / per_req * 100:.1f}% of the request's frontend CPU)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
