"""Clients that leave at random moments, over every generation route, against a live server.

    python bench/disconnects.py                      # 1,000 clients, SmolLM2-135M on CPU
    python bench/disconnects.py --scripted           # the scripted worker (fast)
    python bench/disconnects.py --clients 300 --seed 2

The issue's acceptance scenario: ``--clients`` clients send ``POST /generate`` (a text
prompt or ``input_ids``, half of them with a ``rid``), ``/v1/completions`` and
``/v1/chat/completions`` (the model named by ``/v1/models``), 60 % of them streaming,
``--max-new`` tokens with ``ignore_eos``, in waves of 50-100 at once so the queues fill.
Each leaves at a random moment: at once (right after its request is sent), after 10 ms to
1.5 s, or after reading a few bytes (at most 1.5 s of waiting for them); half of them with
a reset (``SO_LINGER`` 0), half with a clean close (what has arrived is drained first, so
that the kernel sends a FIN and not the RST that closing on unread data implies).

Afterwards ``/server_info`` must show no request (``live_requests`` 0, no tombstones) and
the worker idle with its KV blocks free (``running`` 0, ``kv_blocks_free ==
kv_blocks_total``) within 5 s of the last client leaving; then requests that reuse rids
the leaving clients sent must be served (200, not 400 "Duplicate request ID detected").

Prints the clients per route and per leave kind, the requests leaked (``live_requests`` +
``tombstones``) right after the last client left, at 5 s and after ``--settle`` seconds,
the seconds until idle, the KV blocks not returned, the reused rids' statuses and the
server's RSS (frontend and worker) before and after.

``random_disconnects(url, clients, max_new, seed)`` runs the scenario against a server
that is already up and returns the figures as a dict (for ``bench/reliability.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import socket
import struct
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.procs import ServerProcess, free_port, serve_argv  # noqa: E402

__all__ = ["random_disconnects", "main"]

IDLE_WITHIN_S = 5.0  # the acceptance bound after the last client left
LEAVE_MAX_S = 1.5
ROUTES = ("generate:text", "generate:ids", "completions", "chat")
ROUTE_WEIGHTS = (0.2, 0.2, 0.3, 0.3)
KINDS = ("at once", "after delay", "after bytes")
WORDS = (
    "the quick brown fox jumps over a lazy dog while seven tired engineers watch the "
    "queue fill and drain again under load on a small machine with two cores"
).split()


@dataclass(slots=True)
class Client:
    """One leaving client: what it sent, how it left, what it saw."""

    i: int
    route: str
    stream: bool
    kind: str
    reset: bool
    delay: float
    nbytes: int
    rid: str | None = None
    received: int = 0  # bytes read before leaving
    status: int = 0  # the response's status, when its first line arrived
    error: str | None = None  # connect or send failure
    timed_out: bool = False  # "after bytes" gave up waiting for them
    t_left: float = 0.0


@dataclass(slots=True)
class Snapshot:
    live: int
    tombstones: int
    running: int | None
    kv_free: int | None
    kv_total: int | None
    by_state: dict[str, int] = field(default_factory=dict)

    @property
    def leaked(self) -> int:
        return self.live + self.tombstones

    @property
    def kv_held(self) -> int | None:
        if self.kv_free is None or self.kv_total is None:
            return None
        return self.kv_total - self.kv_free

    @property
    def idle(self) -> bool:
        return self.leaked == 0 and not self.running and self.kv_held == 0


def _snapshot(info: dict[str, Any]) -> Snapshot:
    w = info["internal_states"][0]
    return Snapshot(
        live=int(info["live_requests"]),
        tombstones=int(info.get("tombstones") or 0),
        running=w.get("running"),
        kv_free=w.get("kv_blocks_free"),
        kv_total=w.get("kv_blocks_total"),
        by_state={k: v for k, v in (info.get("requests_by_state") or {}).items() if v},
    )


def _prompt(rnd: random.Random) -> str:
    return " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(4, 24)))


def _body(c: Client, rnd: random.Random, model: str, max_new: int) -> tuple[str, bytes]:
    """The path and JSON body of client ``c``'s request."""
    if c.route.startswith("generate"):
        body: dict[str, Any] = {
            "stream": c.stream,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        }
        if c.route == "generate:text":
            body["text"] = _prompt(rnd)
        else:
            body["input_ids"] = [rnd.randint(100, 20_000) for _ in range(rnd.randint(2, 32))]
        if c.rid is not None:
            body["rid"] = c.rid
        return "/generate", json.dumps(body).encode()
    body = {"model": model, "max_tokens": max_new, "ignore_eos": True, "stream": c.stream}
    if c.route == "completions":
        body["prompt"] = _prompt(rnd)
        path = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": _prompt(rnd)}]
        path = "/v1/chat/completions"
    return path, json.dumps(body).encode()


def _plan(clients: int, seed: int) -> list[Client]:
    rnd = random.Random(seed)
    out: list[Client] = []
    for i in range(clients):
        route = rnd.choices(ROUTES, ROUTE_WEIGHTS)[0]
        c = Client(
            i=i,
            route=route,
            stream=rnd.random() < 0.6,
            kind=KINDS[i % len(KINDS)],
            reset=(i // len(KINDS)) % 2 == 0,  # every kind half with a reset, half clean
            delay=rnd.uniform(0.010, LEAVE_MAX_S),
            nbytes=rnd.randint(1, 64),
        )
        if route.startswith("generate") and rnd.random() < 0.5:
            c.rid = f"disc-{seed}-{i}"
        out.append(c)
    return out


def _leave(sock: socket.socket, reset: bool) -> None:
    if reset:  # close with SO_LINGER 0: the kernel sends RST, not FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    else:  # drain what arrived so that close sends a FIN
        with contextlib.suppress(OSError):
            while sock.recv(65536):
                pass
    sock.close()


async def _client(c: Client, host: str, port: int, path: str, body: bytes) -> None:
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setblocking(False)
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    ).encode()
    try:
        await loop.sock_connect(sock, (host, port))
        await loop.sock_sendall(sock, head + body)
        if c.kind == "after delay":
            await asyncio.sleep(c.delay)
        elif c.kind == "after bytes":
            deadline = loop.time() + LEAVE_MAX_S
            buf = b""
            while len(buf) < c.nbytes:
                left = deadline - loop.time()
                if left <= 0:
                    c.timed_out = True
                    break
                try:
                    chunk = await asyncio.wait_for(loop.sock_recv(sock, c.nbytes - len(buf)), left)
                except TimeoutError:
                    c.timed_out = True
                    break
                if not chunk:
                    break
                buf += chunk
            c.received = len(buf)
            parts = buf.split(b" ", 2)
            if len(parts) > 2 and parts[1].isdigit():  # the whole status code arrived
                c.status = int(parts[1])
    except OSError as exc:
        c.error = type(exc).__name__
    finally:
        _leave(sock, c.reset)
        c.t_left = time.monotonic()


async def _info(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    return dict((await http.get(url + "/server_info", timeout=30)).json())


def _rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except psutil.Error:
        return None


def _how(c: Client) -> str:
    return f"{c.kind}, {'reset' if c.reset else 'clean'}{', streaming' if c.stream else ''}"


async def _reuse_rids(
    http: httpx.AsyncClient, url: str, plan: list[Client], concurrency: int = 16
) -> list[tuple[str, str, int, str]]:
    """Send one short request for every rid a leaving client used (a leaked request keeps
    its rid, so sampling a few could miss it): (rid, how its client left, status, error
    message), in the plan's order."""
    sem = asyncio.Semaphore(concurrency)

    async def one(c: Client) -> tuple[str, str, int, str]:
        body = {"text": "reused", "rid": c.rid, "sampling_params": {"max_new_tokens": 1}}
        async with sem:
            try:
                r = await http.post(url + "/generate", json=body, timeout=120)
                status, msg = r.status_code, ""
                if status != 200:
                    with contextlib.suppress(ValueError, AttributeError):
                        msg = str(r.json()["error"]["message"])
                    msg = (msg or r.text).replace(str(c.rid), "<rid>")[:60]
            except httpx.HTTPError as exc:
                status, msg = 0, type(exc).__name__
        return str(c.rid), _how(c), status, msg

    return list(await asyncio.gather(*(one(c) for c in plan if c.rid is not None)))


async def random_disconnects(
    url: str,
    clients: int,
    max_new: int,
    seed: int,
    *,
    server_pid: int | None = None,
    settle_s: float = 30.0,
) -> dict[str, Any]:
    """Run the scenario against the server at ``url``; return its figures.

    ``server_pid`` (the frontend's process) adds its RSS; the worker's is read from the
    pid ``/server_info`` reports. ``settle_s``: how long to keep waiting for idle past the
    5 s bound, to tell a slow release from a leak."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    rnd = random.Random(seed + 1)
    plan = _plan(clients, seed)
    async with httpx.AsyncClient(timeout=60) as http:
        model = (await http.get(url + "/v1/models")).json()["data"][0]["id"]
        # Warm-up: one request per route, to completion (first-call costs, allocator).
        warm = [
            ("/generate", {"text": "warm up", "sampling_params": {"max_new_tokens": 4}}),
            ("/v1/completions", {"model": model, "prompt": "warm up", "max_tokens": 4}),
            (
                "/v1/chat/completions",
                {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            ),
        ]
        for path, body in warm:
            (await http.post(url + path, json=body, timeout=300)).raise_for_status()
        info0 = await _info(http, url)
        worker_pid = info0["internal_states"][0].get("pid")
        rss0 = (_rss(server_pid), _rss(worker_pid))
        failed0 = Counter(info0.get("failed_requests") or {})

        t0 = time.monotonic()
        waves: list[int] = []
        i = 0
        while i < clients:
            n = min(clients - i, rnd.randint(50, 100))
            wave = plan[i : i + n]
            jobs = []
            for c in wave:
                path, body = _body(c, rnd, model, max_new)
                jobs.append(_client(c, host, port, path, body))
            await asyncio.gather(*jobs)
            waves.append(n)
            i += n
        t_last = max(c.t_left for c in plan)
        clients_s = t_last - t0

        after_leave = _snapshot(await _info(http, url))
        snap, t_idle = after_leave, None
        while True:  # until idle or the 5 s bound
            if snap.idle:
                t_idle = time.monotonic() - t_last
                break
            if time.monotonic() - t_last > IDLE_WITHIN_S:
                break
            await asyncio.sleep(0.05)
            snap = _snapshot(await _info(http, url))
        at_bound = snap
        reused = await _reuse_rids(http, url, plan)
        settled = at_bound
        if t_idle is None:  # keep waiting: a slow release or a leak?
            while time.monotonic() - t_last < IDLE_WITHIN_S + settle_s:
                settled = _snapshot(await _info(http, url))
                if settled.idle:
                    t_idle = time.monotonic() - t_last
                    break
                await asyncio.sleep(0.1)
        info1 = await _info(http, url)
        rss1 = (_rss(server_pid), _rss(worker_pid))
        failed = Counter(info1.get("failed_requests") or {})
        failed.subtract(failed0)

    return {
        "clients": clients,
        "max_new": max_new,
        "seed": seed,
        "model": model,
        "waves": waves,
        "clients_s": clients_s,
        "by_route": dict(Counter(c.route for c in plan)),
        "streaming": sum(c.stream for c in plan),
        "with_rid": sum(c.rid is not None for c in plan),
        "by_leave": dict(
            Counter(f"{c.kind}, {'reset' if c.reset else 'clean'}" for c in plan).most_common()
        ),
        "after_bytes_timed_out": sum(c.timed_out for c in plan),
        "statuses_seen": dict(Counter(c.status for c in plan if c.status)),
        "client_errors": dict(Counter(c.error for c in plan if c.error)),
        "leaked_after_leave": after_leave.leaked,
        "leaked_at_5s": at_bound.leaked,
        "leaked_after_settle": settled.leaked,
        "settle_s": settle_s,
        "states_at_5s": at_bound.by_state,
        "states_after_settle": settled.by_state,
        "running_at_5s": at_bound.running,
        "kv_blocks_total": at_bound.kv_total,
        "kv_not_returned_at_5s": at_bound.kv_held,
        "kv_not_returned_after_settle": settled.kv_held,
        "idle_after_s": t_idle,
        "idle_within_5s": t_idle is not None and t_idle <= IDLE_WITHIN_S,
        "reused_rids": reused,
        "failed_requests": {k: v for k, v in failed.items() if v},
        "rss_frontend": (rss0[0], rss1[0]),
        "rss_worker": (rss0[1], rss1[1]),
    }


def _mib(pair: tuple[int | None, int | None]) -> str:
    a, b = pair
    if a is None or b is None:
        return "n/a"
    return f"{a / 2**20:.1f} -> {b / 2**20:.1f} MiB ({(b - a) / 2**20:+.1f})"


def report(r: dict[str, Any]) -> str:
    idle = r["idle_after_s"]
    idle_s = (
        f"{idle:.2f} s"
        if idle is not None
        else f"not idle after {IDLE_WITHIN_S + r['settle_s']:g} s"
    )
    reused = r["reused_rids"]
    served = sum(st == 200 for _, _, st, _ in reused)
    refused = Counter(f"{st} {msg!r}" if msg else str(st) for _, _, st, msg in reused if st != 200)
    by_how = Counter(how for _, how, st, _ in reused if st != 200)
    of_how = Counter(how for _, how, _, _ in reused)
    reused_s = f"{served}/{len(reused)} served"
    if refused:
        hows = ", ".join(f"{how} {n} of {of_how[how]}" for how, n in by_how.most_common())
        reused_s += f"; {dict(refused)}; refused by how their client left: {hows}"
    rows = [
        ("clients", f"{r['clients']} in {len(r['waves'])} waves of 50-100, "
                    f"{r['clients_s']:.1f} s; {r['streaming']} streaming, {r['with_rid']} "
                    f"with a rid; max_new {r['max_new']}, ignore_eos"),
        ("clients per route", ", ".join(f"{k} {v}" for k, v in sorted(r["by_route"].items()))),
        ("clients per leave kind", ", ".join(f"{k} {v}" for k, v in r["by_leave"].items())
         + f" ({r['after_bytes_timed_out']} 'after bytes' gave up waiting)"),
        ("statuses / client errors", f"{r['statuses_seen']} / {r['client_errors'] or 'none'}"),
        ("leaked right after the last client left", str(r["leaked_after_leave"])),
        ("leaked at 5 s (target 0)", f"{r['leaked_at_5s']} {r['states_at_5s'] or ''}".strip()),
        (f"leaked after {IDLE_WITHIN_S + r['settle_s']:g} s",
         f"{r['leaked_after_settle']} {r['states_after_settle'] or ''}".strip()),
        ("seconds until idle (target <= 5)", idle_s),
        ("worker running at 5 s (target 0)", str(r["running_at_5s"])),
        ("KV blocks not returned at 5 s (target 0)",
         f"{r['kv_not_returned_at_5s']} of {r['kv_blocks_total']}"),
        (f"KV blocks not returned after {IDLE_WITHIN_S + r['settle_s']:g} s",
         str(r["kv_not_returned_after_settle"])),
        ("reused rids (target all 200)", reused_s),
        ("failed_requests during the run", str(r["failed_requests"])),
        ("frontend RSS", _mib(r["rss_frontend"])),
        ("worker RSS", _mib(r["rss_worker"])),
    ]  # fmt: skip
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)} | {v}" for k, v in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--scripted", action="store_true", help="scripted worker, no model")
    p.add_argument("--step-delay", type=float, default=0.02, help="scripted worker's step (s)")
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle", type=float, default=30.0, help="wait past 5 s for idle (s)")
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--max-pending", type=int, default=32)
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="real model only")
    p.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = p.parse_args()
    port = free_port()
    flags: dict[str, object] = {"max_running": args.max_running, "max_pending": args.max_pending}
    if not args.scripted:
        flags["kv_cache_tokens"] = args.kv_cache_tokens
    cmd = serve_argv(port, scripted=args.scripted, step_delay=args.step_delay, **flags)
    t0 = time.monotonic()
    srv = ServerProcess.start("disconnects", cmd, port, "/health", timeout_s=600, cwd=ROOT)
    try:
        url = f"http://{srv.host}:{srv.port}"
        r = asyncio.run(
            random_disconnects(
                url,
                args.clients,
                args.max_new,
                args.seed,
                server_pid=srv.popen.pid,
                settle_s=args.settle,
            )
        )
    finally:
        srv.stop()
    worker = (
        f"scripted worker, step {args.step_delay * 1000:g} ms"
        if args.scripted
        else "SmolLM2-135M on CPU"
    )
    print(
        f"\nRandom disconnects ({worker}; --max-running {args.max_running} --max-pending "
        f"{args.max_pending}; seed {args.seed}; {time.monotonic() - t0:.0f} s in all)\n"
    )
    print(report(r))
    if args.json:
        print(json.dumps(r))
    ok = r["idle_within_5s"] and all(st == 200 for _, _, st, _ in r["reused_rids"])
    print(f"\nacceptance: {'PASS' if ok else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
