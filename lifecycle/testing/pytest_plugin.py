"""pytest plugin (entry point ``pytest11: lifecycle``): fault-injection fixtures for users.

Prove a deployment's release guarantees in your own tests::

    def test_my_client_survives_worker_death(lifecycle_server_factory):
        plan = [FaultRule("worker.forward", "kill", nth=20)]
        with lifecycle_server_factory("--scripted-worker", faults=plan) as srv:
            ...  # drive it with your client
            srv.assert_invariants()

Fixtures:
- ``lifecycle_server_factory``: starts ``lifecycle serve`` as a real process, optionally
  with a fault plan (``wire.faults``, passed to it and its worker by environment);
- ``lifecycle_clients``: raw-socket clients that disconnect at a chosen lifecycle
  state, read slowly, stop reading (stalled), or hold slowloris connections;
- ``LiveServer.assert_invariants``: every request that entered the state machine
  reached exactly one terminal state, no live request or tombstone is left, the
  worker's KV blocks are all free and its books balance.

Everything here is plain functions and classes too, usable without pytest.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.request import Request, urlopen

import pytest

from wire.child import stop_process
from wire.faults import ENV_VAR, FaultPlan, FaultRule

__all__ = [
    "LiveServer",
    "RawClients",
    "free_port",
    "lifecycle_clients",
    "lifecycle_server_factory",
    "start_server",
]

SCRIPTED = ("--scripted-worker",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _http(url: str, body: Any = None, timeout: float = 10.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except OSError as exc:  # HTTPError is an OSError with a status
        status = getattr(exc, "code", None)
        if status is None:
            raise
        return int(status), exc.read()  # type: ignore[attr-defined]


@dataclass
class LiveServer:
    url: str
    proc: subprocess.Popen[bytes]
    host: str = "127.0.0.1"
    port: int = 0
    plan_path: str | None = None  # a plan file the worker (re)reads each time it starts

    def info(self) -> dict[str, Any]:
        status, body = _http(self.url + "/server_info")
        assert status == 200, body
        return dict(json.loads(body))

    def worker(self) -> dict[str, Any]:
        return dict(self.info()["internal_states"][0])

    def health(self) -> int:
        return _http(self.url + "/health", timeout=5)[0]

    def wait_until(self, what: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            if what(info):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout}s: {info}")
            time.sleep(0.02)

    def wait_state(self, state: str, n: int = 1, timeout: float = 5.0) -> None:
        """Until ``n`` requests are in lifecycle ``state`` (queued, running, streaming)."""
        self.wait_until(lambda i: i.get("requests_by_state", {}).get(state, 0) >= n, timeout)

    def kill_worker(self, timeout: float = 30.0) -> None:
        """SIGKILL the worker; returns once a new one is up and the server is ready."""
        old = self.worker()["pid"]
        os.kill(old, signal.SIGKILL)
        self.wait_replaced(old, timeout)

    def wait_replaced(self, old_pid: int, timeout: float = 30.0) -> None:
        """Until a worker other than ``old_pid`` is up and the server is ready."""
        old = old_pid
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health() == 200 and self.worker()["pid"] not in (old, None):
                    return
            except (OSError, KeyError):
                pass
            assert time.monotonic() < deadline, "the worker did not come back"
            time.sleep(0.05)

    def replan_worker(self, rules: list[FaultRule], restart: bool = True) -> None:
        """Write the worker's fault plan; with ``restart`` a fresh worker loads it now."""
        assert self.plan_path is not None, "start_server(..., faults=<path>) for a worker plan"
        with open(self.plan_path, "w", encoding="utf-8") as f:
            f.write(FaultPlan(rules).to_json())
        if restart:
            self.kill_worker()

    def replan_frontend(self, rules: list[FaultRule]) -> None:
        """Write the plan file and make the frontend reload it (SIGHUP) now."""
        self.replan_worker(rules, restart=False)
        self.proc.send_signal(signal.SIGHUP)
        time.sleep(0.05)  # the handler runs on the frontend's next bytecode boundary

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != 200:
            assert time.monotonic() < deadline, "server did not become ready"
            time.sleep(0.05)

    def assert_invariants(self, timeout: float = 5.0) -> dict[str, Any]:
        """Wait until idle, then check the release invariants; returns the last info."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.info()
            problems = invariant_problems(info)
            if not problems:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"invariants violated: {problems}; info={info}")
            time.sleep(0.02)


def invariant_problems(info: dict[str, Any]) -> list[str]:
    """What is wrong with an idle server's books (empty when all is well)."""
    p: list[str] = []
    if info["live_requests"]:
        p.append(f"live_requests={info['live_requests']}")
    if info.get("tombstones"):
        p.append(f"tombstones={info['tombstones']}")
    ended = info.get("finished_requests", 0) + sum(info.get("failed_requests", {}).values())
    if "received_requests" in info and ended != info["received_requests"]:
        p.append(f"received={info['received_requests']} but ended={ended}")
    w = info["internal_states"][0]
    if w.get("kv_blocks_free") != w.get("kv_blocks_total"):
        p.append(f"kv free {w.get('kv_blocks_free')} of {w.get('kv_blocks_total')}")
    if w.get("running") or w.get("waiting"):
        p.append(f"worker running={w.get('running')} waiting={w.get('waiting')}")
    if w.get("in_flight") or w.get("dispatch_queue"):
        p.append(f"in_flight={w.get('in_flight')} dispatch_queue={w.get('dispatch_queue')}")
    if w.get("worker_load", {}).get("integrity_ok") is False:
        p.append("worker KV integrity check failed")
    return p


def _plan_json(faults: FaultPlan | list[FaultRule] | str | None) -> str | None:
    if faults is None or isinstance(faults, str):
        return faults
    plan = faults if isinstance(faults, FaultPlan) else FaultPlan(list(faults))
    return plan.to_json()


@contextmanager
def start_server(
    *args: str,
    faults: FaultPlan | list[FaultRule] | str | None = None,
    ready: bool = True,
    timeout: float = 60.0,
) -> Iterator[LiveServer]:
    """``python -m lifecycle serve ARGS`` on a free port, with an optional fault plan
    (rules, a plan, JSON text, or the path of a plan file: see ``replan_worker``)."""
    env = dict(os.environ)
    env.pop(ENV_VAR, None)
    plan = _plan_json(faults)
    if plan is not None:
        env[ENV_VAR] = plan
    path = plan if plan is not None and os.path.isfile(plan) else None
    for _ in range(3):  # a port found free may be another test's server's by now
        port = free_port()
        argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port), *args]
        argv += ["--log-level", "warning"]
        if path is not None:
            argv += ["--faults", path]  # reloadable: replan_frontend, replan_worker
        proc = subprocess.Popen(argv, env=env)
        srv = LiveServer(f"http://127.0.0.1:{port}", proc, port=port, plan_path=path)
        try:
            _wait_ready(srv, proc, ready, timeout)
        except BaseException:
            stop_process(proc)
            raise
        if not ready or _serves_here(srv, proc):
            break
        stop_process(proc)
    else:
        raise AssertionError("another server answered on each of three free ports")
    try:
        yield srv
    finally:
        stop_process(proc)


def _wait_ready(
    srv: LiveServer, proc: subprocess.Popen[bytes], ready: bool, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "server did not start"
        try:
            if srv.health() == 200 or not ready:
                return
        except OSError:
            pass
        time.sleep(0.05)


def _serves_here(srv: LiveServer, proc: subprocess.Popen[bytes]) -> bool:
    """Whether the server answering on ``srv``'s port is ``proc`` (or a frontend it
    launched, ``--frontends N``): between ``free_port`` and the bind, another test's
    server may take the port, and its /health answers for it."""
    status, body = _http(srv.url + "/server_info")
    if status != 200:  # behind an API key: that it still runs is what can be told
        return proc.poll() is None
    pid = json.loads(body).get("frontend_pid")
    return pid == proc.pid or _parent_pid(pid) == proc.pid


def _parent_pid(pid: Any) -> int | None:
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text()
    except (OSError, TypeError, ValueError):
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


class RawClients:
    """Raw-socket HTTP clients with the misbehaviours the fault suite needs."""

    def __init__(self, server: LiveServer) -> None:
        self.server = server
        self._socks: list[socket.socket] = []

    def open(self, body: dict[str, Any], path: str = "/generate", rcvbuf: int = 0) -> socket.socket:
        """Send a whole request; the response is left unread."""
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.connect((self.server.host, self.server.port))
        data = json.dumps(body).encode()
        head = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        sock.sendall(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
        self._socks.append(sock)
        return sock

    def disconnect_at(self, body: dict[str, Any], state: str, timeout: float = 5.0) -> None:
        """Send ``body``, wait until a request is in ``state``, then hang up."""
        sock = self.open(body)
        self.server.wait_state(state, timeout=timeout)
        sock.close()

    def stalled_reader(self, body: dict[str, Any]) -> socket.socket:
        """A streaming client that never reads (a tiny receive buffer fills fast)."""
        return self.open({**body, "stream": True}, rcvbuf=4096)

    def slow_reader(self, body: dict[str, Any], pause: float) -> bytes:
        """Read the whole response ``pause`` seconds per 1 KiB read."""
        sock = self.open(body)
        got = bytearray()
        while True:
            chunk = sock.recv(1024)
            if not chunk:
                return bytes(got)
            got += chunk
            if got.endswith(b"0\r\n\r\n"):
                return bytes(got)
            time.sleep(pause)

    def slowloris(self, n: int) -> list[socket.socket]:
        """``n`` connections that send a partial request line and nothing more."""
        out = []
        for _ in range(n):
            s = socket.create_connection((self.server.host, self.server.port))
            s.sendall(b"POST /generate HTTP/1.1\r\nhost: x\r\n")
            out.append(s)
        self._socks += out
        return out

    def close(self) -> None:
        for s in self._socks:
            s.close()
        self._socks.clear()


@pytest.fixture
def lifecycle_server_factory() -> Callable[..., AbstractContextManager[LiveServer]]:
    """``factory(*serve_args, faults=plan)``: a context manager yielding a ``LiveServer``."""
    return start_server


@pytest.fixture
def lifecycle_clients() -> Iterator[Callable[[LiveServer], RawClients]]:
    made: list[RawClients] = []

    def make(server: LiveServer) -> RawClients:
        made.append(RawClients(server))
        return made[-1]

    yield make
    for c in made:
        c.close()
