"""Signals as real supervisors send them (issue 53, point 6).

Ctrl-C in a terminal is SIGINT to the whole foreground process group, systemd's default
``KillMode=control-group`` is SIGTERM to every process of the service, and ``kill PID``
reaches one process. Each, sent during streams, drains the same way: every stream
completes (the worker ignores both signals and stops on its frontend's SHUTDOWN,
``wire/child.py``), the server exits 0 and leaves no process behind. With
``--frontends 2`` every frontend drains at once (new requests are refused by all of
them from the signal on, the exit bounded by one drain), and a SIGKILLed launcher takes
its frontends and workers with it within a second. A real server, its processes started
in a group of their own as a shell would, the scripted worker."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest

from tests.scripted import ROOT, count_stream, free_port

pytestmark = pytest.mark.timeout(120)

TOKENS = 150  # at 10 ms a step: 1.5 s a stream
STREAMS = 6
DRAIN_TIMEOUT = 20.0


@contextmanager
def _server(*args: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``lifecycle serve`` leading a process group of its own (a terminal's job)."""
    port = free_port()
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port), "--scripted-worker",
            "--worker-args", "--step-delay 0.01", "--log-level", "warning",
            "--drain-timeout", str(DRAIN_TIMEOUT), *args]  # fmt: skip
    proc = subprocess.Popen(argv, cwd=ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while _status(url) != 200:
            assert proc.poll() is None and time.monotonic() < deadline, "not ready"
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _status(url: str, path: str = "/health") -> int:
    try:
        return httpx.get(url + path, timeout=5, headers={"Connection": "close"}).status_code
    except httpx.TransportError:
        return 0


def _group_left(pgid: int) -> list[str]:
    """The processes still in the group ``pgid``."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if os.getpgid(p.info["pid"]) == pgid:
                out.append(" ".join(p.info["cmdline"] or []))
        except (ProcessLookupError, psutil.Error):
            continue
    return out


def _signal_during_streams(url: str, send: object, tokens: int = TOKENS) -> list[tuple[str, int]]:
    """``STREAMS`` streams of ``tokens``; once each is under way, ``send()``; their
    outcomes."""

    async def run() -> list[tuple[str, int]]:
        progress = [0] * STREAMS
        tasks = [
            asyncio.create_task(count_stream(url, i, tokens, progress)) for i in range(STREAMS)
        ]
        deadline = time.monotonic() + 30
        while min(progress) == 0:
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.02)
        send()  # type: ignore[operator]
        return await asyncio.gather(*tasks)

    return asyncio.run(run())


HOW = {
    "ctrl-c": lambda p: os.killpg(p.pid, signal.SIGINT),
    "group-sigterm": lambda p: os.killpg(p.pid, signal.SIGTERM),
    "pid-sigterm": lambda p: os.kill(p.pid, signal.SIGTERM),
}


@pytest.mark.parametrize("how", list(HOW))
def test_every_signal_drains_the_streams(how: str) -> None:
    with _server() as (proc, url):
        outcomes = _signal_during_streams(url, lambda: HOW[how](proc))
        assert outcomes == [("done", TOKENS)] * STREAMS, outcomes
        assert proc.wait(30) == 0
        assert _group_left(proc.pid) == []  # the worker went with its frontend


LONGER = 400  # 4 s a stream: a drain of one frontend after the other takes that long


@pytest.mark.parametrize("how", list(HOW))
def test_every_signal_drains_every_frontend_at_once(how: str) -> None:
    """From the signal on, new connections (spread by the kernel over both frontends)
    are refused by both: 16 in a row within 2.5 s, while the streams (4 s) still run;
    one frontend drained after the other would serve them until the first's ended."""
    with _server("--frontends", "2") as (proc, url):
        row: list[int] = []
        took: list[float] = []

        def send() -> None:
            t = time.monotonic()
            HOW[how](proc)
            while len(row) < 16 or any(s not in (503, 0) for s in row[-16:]):
                assert time.monotonic() - t < 10, row
                row.append(_status(url, "/health"))
            took.append(time.monotonic() - t)

        t0 = time.monotonic()
        outcomes = _signal_during_streams(url, send, LONGER)
        assert outcomes == [("done", LONGER)] * STREAMS, outcomes
        assert took[0] < 2.5, (took, row)
        assert proc.wait(30) == 0
        # one drain (the streams' ~4 s and the close), not one per frontend in turn
        assert time.monotonic() - t0 < DRAIN_TIMEOUT, time.monotonic() - t0
        assert _group_left(proc.pid) == []


def test_a_killed_launcher_leaves_no_frontend_or_worker() -> None:
    with _server("--frontends", "2") as (proc, _url):
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 3  # two frontends and a worker (and their own children)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 1.0
        alive = children
        while alive and time.monotonic() < deadline:
            time.sleep(0.05)
            alive = [c for c in alive if _running(c)]
        assert alive == [], [" ".join(c.cmdline()) for c in alive]


def _running(p: psutil.Process) -> bool:
    """Whether ``p`` still runs (a zombie does not; one reaped meanwhile neither)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
