"""Reliability figures, each from a run against a live server (real model by default).

    python bench/reliability.py            # reduced counts (a few minutes on 2 CPU cores)
    python bench/reliability.py --full     # the counts of the issue (10,000 invalid, ...)
    python bench/reliability.py --scripted # the scripted worker instead of the model

Prints one table: invalid requests (share answered 4xx with the documented body, RSS
growth), client disconnects over every lifecycle state (leaked requests, KV blocks not
returned), worker killed mid-batch (time to every client's error, time to recover,
silent losses), a stalled SSE reader among 31 normal streams (their inter-token latency
against a run without it, the stalled one's outcome), slowloris connections (a normal
client's latency), a burst at 10x capacity (503 share with Retry-After, RSS growth, time
to recover), the issue's random disconnects (bench/disconnects.py: leaked requests,
KV blocks, reused rids), the seeded simulation (tests/simulation.py: scenarios run,
leaks found, broken invariants; 10,000 with --full) and the deterministic simulation
(tests/dsim: the real server on virtual time with a seeded schedule, in memory;
scenarios run, distinct shapes, violations; 100,000 with --full). The counts used are
printed with each figure.

    python bench/reliability.py --dsim 100000   # the deterministic simulation alone,
                                                # no server started (2 processes)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import ServerProcess, free_port, serve_argv  # noqa: E402
from bench.simulation_figures import Row, dsim, simulation  # noqa: E402

MAX_PENDING, MAX_QUEUED = 8, 16
ROWS: list[Row] = []  # figure, counts, value, target


def row(figure: str, counts: str, value: str, target: str) -> None:
    ROWS.append((figure, counts, value, target))
    print(f"  {figure}: {value} ({counts}; target {target})", flush=True)


class Bench:
    def __init__(self, srv: ServerProcess) -> None:
        self.srv = srv
        self.url = f"http://{srv.host}:{srv.port}"
        self.proc = psutil.Process(srv.popen.pid)

    def info(self) -> dict[str, Any]:
        return dict(httpx.get(self.url + "/server_info", timeout=30).json())

    def rss(self) -> int:
        return int(self.proc.memory_info().rss)

    async def idle(self, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            w = info["internal_states"][0]
            if info["live_requests"] == 0 and not info["tombstones"] and not w.get("running"):
                if w.get("kv_blocks_free") == w.get("kv_blocks_total"):
                    return info
            if time.monotonic() > deadline:
                return info
            await asyncio.sleep(0.05)

    async def raw(self, body: bytes, path: str = "/generate", rcvbuf: int = 0) -> Any:
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, (self.srv.host, self.srv.port))
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        await loop.sock_sendall(sock, f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
        return sock


def invalid_bodies(vocab: int) -> list[tuple[str, bytes]]:
    big = b'{"text": "' + b"x" * (9 * 2**20) + b'"}'
    cases: list[tuple[str, Any]] = [
        ("malformed JSON", b'{"text": "hi", '),
        ("malformed JSON", b"\xff\xfe not json"),
        ("wrong type", {"text": 5}),
        ("wrong type", {"input_ids": "abc"}),
        ("wrong type", {"text": "x", "sampling_params": {"max_new_tokens": "many"}}),
        ("out of range", {"text": "x", "sampling_params": {"temperature": -1}}),
        ("out of range", {"text": "x", "sampling_params": {"top_p": 2}}),
        ("out of range", {"text": "x", "sampling_params": {"max_new_tokens": 10**9}}),
        ("out of range", {"input_ids": [vocab + 5]}),
        (
            "ragged logprob ids",
            {"text": "x", "return_logprob": True, "token_ids_logprob": [[1], 2]},
        ),
        ("unknown field", {"text": "x", "sampling_params": {"no_such_param": 1}}),
        ("oversized body", big),
    ]
    return [(k, v if isinstance(v, bytes) else json.dumps(v).encode()) for k, v in cases]


async def fig_invalid(b: Bench, n: int, vocab: int) -> None:
    bodies = invalid_bodies(vocab)
    ok, bad_kinds = 0, {}
    sem = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=60) as c:

        async def one(i: int) -> None:
            nonlocal ok
            kind, body = bodies[i % len(bodies)]
            if kind == "oversized body" and i % (len(bodies) * 10) != len(bodies) - 1:
                kind, body = bodies[0]  # a 9 MiB body every 10th round keeps the run short
            async with sem:
                try:
                    r = await c.post(
                        b.url + "/generate",
                        content=body,
                        headers={"content-type": "application/json"},
                    )
                    good = 400 <= r.status_code < 500 and isinstance(
                        r.json().get("error", {}).get("message"), str
                    )
                except (httpx.HTTPError, ValueError):
                    good = False
            if good:
                ok += 1
            else:
                bad_kinds[kind] = bad_kinds.get(kind, 0) + 1

        await asyncio.gather(*(one(i) for i in range(min(n, 500))))  # warm-up: allocator
        ok, bad_kinds = 0, {}
        rss0 = b.rss()
        await asyncio.gather(*(one(i) for i in range(n)))
        growth = (b.rss() - rss0) / 1024
    detail = f" failures by kind {bad_kinds}" if bad_kinds else ""
    row(
        "invalid requests: 4xx + documented body",
        f"{n} requests",
        f"{100 * ok / n:.2f}%{detail}",
        "100%",
    )
    row(
        "invalid requests: frontend RSS growth", f"{n} requests", f"{growth:.0f} KiB", "<= 1024 KiB"
    )


async def fig_disconnects(b: Bench, n: int, max_new: int) -> None:
    """Disconnects spread over the lifecycle: before the body ends, queued, running,
    streaming (unary and SSE), at random moments."""
    loop = asyncio.get_running_loop()
    seen: dict[str, int] = {}
    rnd = random.Random(1)

    async def one(i: int) -> None:
        stream = i % 2 == 0
        body = json.dumps(
            {
                "input_ids": [100 + i % 50, 7],
                "stream": stream,
                "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
            }
        )
        if i % 7 == 0:  # mid-request: headers promise more body than is sent
            sock = socket.create_connection((b.srv.host, b.srv.port))
            sock.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 999\r\n\r\n{")
            sock.close()
            seen["mid-request"] = seen.get("mid-request", 0) + 1
            return
        sock = await b.raw(body.encode())
        if stream and i % 3 == 0:
            await loop.sock_recv(sock, 4096)  # headers and maybe the first event: streaming
            await asyncio.sleep(rnd.random() * 0.2)
            kind = "streaming"
        else:
            await asyncio.sleep(rnd.choice([0.0, 0.001, 0.01, 0.05, 0.2]))
            kind = "queued/running"
        sock.close()
        seen[kind] = seen.get(kind, 0) + 1

    for start in range(0, n, 50):  # waves of 50 so queues fill and drain
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 50))))
    info = await b.idle()
    w = info["internal_states"][0]
    leaked = info["live_requests"] + info["tombstones"]
    counts = f"{n} disconnects: {seen}"
    row("disconnects: leaked requests", counts, str(leaked), "0")
    row(
        "disconnects: KV blocks not returned",
        counts,
        str(w["kv_blocks_total"] - w["kv_blocks_free"]),
        "0",
    )


async def _stream(url: str, body: dict[str, Any], out: dict[str, Any]) -> None:
    """Consume one SSE stream; records arrival times, the last event, errors."""
    out.update(times=[], last=None, error=None, finished=False, end_t=None)
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            async with c.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    ev = json.loads(data)
                    out["times"].append(time.monotonic())
                    if "error" in ev:
                        out["error"] = ev["error"]
                    elif ev["meta_info"]["finish_reason"] is not None:
                        out["finished"] = True
                    out["last"] = ev
    except httpx.HTTPError as exc:
        out["error"] = {"transport": str(exc)}
    out["end_t"] = time.monotonic()


async def fig_worker_kill(b: Bench, conc: int, max_new: int) -> None:
    body = {
        "input_ids": [5, 6, 7],
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
    }
    outs = [dict() for _ in range(conc)]
    tasks = [asyncio.create_task(_stream(b.url, body, o)) for o in outs]
    deadline = time.monotonic() + 120
    while not all(o.get("times") for o in outs) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    pid = b.info()["internal_states"][0]["pid"]
    t_kill = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    await asyncio.gather(*tasks)
    to_error = max(o["end_t"] for o in outs) - t_kill
    silent = sum(1 for o in outs if not o["error"] and not o["finished"])
    async with httpx.AsyncClient(timeout=60) as c:
        while True:
            r = await c.post(
                b.url + "/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
            )
            if r.status_code == 200:
                break
            await asyncio.sleep(0.05)
    recover = time.monotonic() - t_kill
    counts = f"{conc} streams in flight"
    row(
        "worker killed: time until every client has its error", counts, f"{to_error:.3f} s", "< 1 s"
    )
    row("worker killed: time until the next request succeeds", counts, f"{recover:.2f} s", "-")
    row("worker killed: requests lost silently", counts, str(silent), "0")


def _itl(outs: list[dict[str, Any]]) -> float:
    gaps = [b - a for o in outs for a, b in zip(o["times"], o["times"][1:], strict=False)]
    return sum(gaps) / max(1, len(gaps))


async def fig_stalled_reader(b: Bench, max_new: int) -> None:
    body = {
        "input_ids": [9, 10, 11],
        "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
    }
    base = [dict() for _ in range(32)]
    await asyncio.gather(*(_stream(b.url, body, o) for o in base))
    before = b.info()["failed_requests"].get("client_stalled", 0)
    rss0 = b.rss()
    stalled_body = json.dumps(
        {
            "input_ids": [12, 13],
            "stream": True,
            "return_logprob": True,
            "top_logprobs_num": 20,
            "return_text_in_logprobs": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True},
        }
    ).encode()
    t_open = time.monotonic()
    sock = await b.raw(stalled_body, rcvbuf=4096)
    others = [dict() for _ in range(31)]
    await asyncio.gather(*(_stream(b.url, body, o) for o in others))
    deadline = time.monotonic() + 120
    while b.info()["failed_requests"].get("client_stalled", 0) <= before:
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    stalled = b.info()["failed_requests"].get("client_stalled", 0) - before
    ended_after = time.monotonic() - t_open
    growth = (b.rss() - rss0) / 2**20
    sock.close()
    after = [dict() for _ in range(32)]  # a second baseline: the machine's load drifts
    await asyncio.gather(*(_stream(b.url, body, o) for o in after))
    a1, a2, s = _itl(base), _itl(after), _itl(others)
    a = (a1 + a2) / 2
    row(
        "stalled SSE reader: others' mean ITL vs without it",
        "31 streams + 1 stalled",
        f"{1000 * s:.1f} ms vs {1000 * a:.1f} ms ({100 * (s / a - 1):+.1f}%; baselines "
        f"{1000 * a1:.1f}/{1000 * a2:.1f} ms)",
        "within 10%",
    )
    row(
        "stalled SSE reader: its outcome",
        "1 stalled",
        f"{f'ended client_stalled after {ended_after:.1f} s' if stalled else 'NOT ended'}, "
        f"RSS {growth:+.1f} MiB",
        "explicit error, bounded memory",
    )


async def fig_slowloris(b: Bench, n: int) -> None:
    """``n`` connections that sent half a request line; then a normal client, 5 times.
    A refused or failed attempt is retried: the figure is the time until it got its
    answer (the transport closes a slowloris connection at ``header_timeout``)."""
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection((b.srv.host, b.srv.port))
            s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\n")
            socks.append(s)
        except OSError:
            break
    lat, refused = [], 0
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 1}}
    async with httpx.AsyncClient(timeout=30) as c:
        for _ in range(5):
            t = time.monotonic()
            while time.monotonic() - t < 60:
                try:
                    if (await c.post(b.url + "/generate", json=body)).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                refused += 1
                await asyncio.sleep(0.1)
            lat.append(time.monotonic() - t)
    for s in socks:
        s.close()
    note = f", {refused} attempts refused or failed" if refused else ""
    row(
        "slowloris: a normal client's latency (max of 5)",
        f"{len(socks)} slowloris connections",
        f"{max(lat):.3f} s{note}",
        "< 1 s",
    )


async def fig_burst(b: Bench, max_new: int) -> None:
    n = 10 * (MAX_PENDING + MAX_QUEUED)
    rss0 = b.rss()
    body = {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True}}
    limits = httpx.Limits(max_connections=n + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        rs = await asyncio.gather(
            *(c.post(b.url + "/generate", json=body) for _ in range(n)), return_exceptions=True
        )
        t_end = time.monotonic()
        growth = (b.rss() - rss0) / 2**20
        while (
            await c.post(
                b.url + "/generate",
                json={"input_ids": [1], "sampling_params": {"max_new_tokens": 1}},
            )
        ).status_code != 200:
            await asyncio.sleep(0.02)
        recover = time.monotonic() - t_end
    refused = [r for r in rs if isinstance(r, httpx.Response) and r.status_code == 503]
    with_retry = sum(1 for r in refused if r.headers.get("retry-after"))
    served = sum(1 for r in rs if isinstance(r, httpx.Response) and r.status_code == 200)
    counts = f"{n} at once, capacity {MAX_PENDING}+{MAX_QUEUED}"
    row(
        "burst 10x: answered 503 with Retry-After",
        counts,
        f"{100 * with_retry / n:.1f}% ({served} served, {n - served - len(refused)} other)",
        "-",
    )
    row("burst 10x: frontend RSS growth", counts, f"{growth:.1f} MiB", "flat")
    row("burst 10x: time to recover", counts, f"{recover:.3f} s", "-")


async def fig_random_disconnects(b: Bench, clients: int, max_new: int) -> None:
    """The issue's scenario (bench/disconnects.py) against this run's server."""
    from bench.disconnects import random_disconnects

    r = await random_disconnects(b.url, clients, max_new, 1, server_pid=b.srv.popen.pid)
    counts = f"{clients} clients leaving at random, {max_new} tokens"
    row("random disconnects: leaked after 5 s", counts, str(r["leaked_at_5s"]), "0")
    row("random disconnects: KV blocks not returned", counts, str(r["kv_not_returned_at_5s"]), "0")
    refused = sum(1 for _rid, _how, status, _msg in r["reused_rids"] if status != 200)
    row("random disconnects: reused rids refused", counts, str(refused), "0")


async def _rows(figures: Awaitable[list[Row]]) -> None:
    for r in await figures:
        row(*r)


async def main_async(args: argparse.Namespace, b: Bench, vocab: int) -> None:
    full = args.full
    figures = {
        "invalid": lambda: fig_invalid(b, 10_000 if full else 2_000, vocab),
        "disconnects": lambda: fig_disconnects(b, 1_000 if full else 200, args.tokens),
        "worker-kill": lambda: fig_worker_kill(b, MAX_PENDING, args.tokens),
        "stalled-reader": lambda: fig_stalled_reader(b, args.tokens // 2),
        "slowloris": lambda: fig_slowloris(b, 1_000 if full else 300),
        "burst": lambda: fig_burst(b, 8),
        "random-disconnects": lambda: fig_random_disconnects(b, 1_000 if full else 300, 256),
        "simulation": lambda: _rows(simulation(args.scenarios or (10_000 if full else 1_000))),
        "dsim": lambda: _rows(asyncio.to_thread(dsim, 100_000 if full else 10_000, args.jobs)),
    }
    for name, figure in figures.items():
        if args.only and name not in args.only:
            continue
        print(f"{name} ...", flush=True)
        await figure()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--full", action="store_true", help="the issue's counts")
    p.add_argument("--scripted", action="store_true", help="scripted worker, no model")
    p.add_argument("--tokens", type=int, default=32, help="max_new_tokens of long requests")
    p.add_argument(
        "--only",
        action="append",
        choices=[
            "invalid",
            "disconnects",
            "worker-kill",
            "stalled-reader",
            "slowloris",
            "burst",
            "random-disconnects",
            "simulation",
            "dsim",
        ],
        help="run just this figure (repeatable)",
    )
    p.add_argument("--scenarios", type=int, default=0, help="simulation seeds (default 1,000)")
    p.add_argument("--dsim", type=int, default=0, metavar="N",
                   help="only the deterministic simulation, N seeds, no server started")  # fmt: skip
    p.add_argument("--jobs", type=int, default=2, help="processes for the deterministic simulation")
    args = p.parse_args()
    if args.dsim:
        for r in dsim(args.dsim, args.jobs):
            row(*r)
        print_table("deterministic simulation, no server")
        return 0
    port = free_port()
    cmd = serve_argv(
        port,
        scripted=args.scripted,
        max_pending=MAX_PENDING,
        max_running=MAX_PENDING,
        max_queued=MAX_QUEUED,
        send_timeout=2,
        hung_timeout=10,
        restart_backoff=0.1,
    )
    srv = ServerProcess.start("reliability", cmd, port, "/health", timeout_s=600, cwd=ROOT)
    try:
        b = Bench(srv)
        vocab = httpx.get(b.url + "/model_info").json()["vocab_size"]
        asyncio.run(main_async(args, b, vocab))
    finally:
        srv.stop()
    worker = "scripted worker" if args.scripted else "SmolLM2-135M on CPU"
    print_table(f"{worker}; {'full' if args.full else 'reduced'} counts")
    return 0


def print_table(title: str) -> None:
    print(f"\nReliability ({title})\n")
    w = [max(len(r[i]) for r in ROWS) for i in range(4)]
    head = ("figure", "counts", "value", "target")
    print(" | ".join(h.ljust(w[i]) for i, h in enumerate(head)))
    print("-+-".join("-" * x for x in w))
    for r in ROWS:
        print(" | ".join(c.ljust(w[i]) for i, c in enumerate(r)))


if __name__ == "__main__":
    raise SystemExit(main())
