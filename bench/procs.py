"""Server processes for the benchmarks: start, wait until ready, read CPU time, stop.

Each server runs in its own process group with its output in a log file, so a failed
start can show why, and stopping it ends what it spawned (a worker process) too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

__all__ = ["ServerProcess", "busy_cpu_seconds", "free_port", "http_status", "serve_argv"]


def serve_argv(
    port: int, *, scripted: bool, step_delay: float = 0.02, **flags: object
) -> list[str]:
    """``lifecycle serve`` on ``port`` with warnings-only logs: the scripted worker
    (stepping every ``step_delay`` s) or the real model on the CPU. ``flags`` become
    options: ``max_running=16`` is ``--max-running 16``."""
    argv = [sys.executable, "-m", "lifecycle", "serve", "--port", str(port)]
    for name, value in {**flags, "log_level": "warning"}.items():
        argv += ["--" + name.replace("_", "-"), str(value)]
    if scripted:
        return [*argv, "--scripted-worker", "--worker-args", f"--step-delay {step_delay}"]
    return [*argv, "--device", "cpu"]


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent busy (every core, every process)."""
    t = psutil.cpu_times()
    return float(sum(t) - t.idle - getattr(t, "iowait", 0.0))


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process could still take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def http_status(host: str, port: int, path: str, timeout: float = 2.0) -> int:
    """The status of ``GET path``, or 0 when the server does not answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
            head = s.recv(64)
    except OSError:
        return 0
    parts = head.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


@dataclass(slots=True)
class ServerProcess:
    """A running server: its process, where it listens, and its log."""

    name: str
    popen: subprocess.Popen[bytes]
    host: str
    port: int
    log_path: Path

    @classmethod
    def start(
        cls,
        name: str,
        cmd: Sequence[str],
        port: int,
        ready_path: str,
        timeout_s: float = 300.0,
        cwd: str | Path | None = None,
        host: str = "127.0.0.1",
    ) -> ServerProcess:
        """Start ``cmd`` and wait until ``GET ready_path`` answers 200."""
        log = Path(tempfile.mkstemp(prefix=f"bench-{name}-", suffix=".log")[1])
        with log.open("wb") as f:
            popen = subprocess.Popen(
                list(cmd), cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
            )
        proc = cls(name, popen, host, port, log)
        proc.wait_ready(ready_path, timeout_s)
        return proc

    @classmethod
    def start_baseline(
        cls, python: str, cwd: str | Path, extra: Sequence[str] = (), timeout_s: float = 60.0
    ) -> ServerProcess:
        """The FastAPI baseline on a port of its own choosing (it prints ``LISTENING``)."""
        log = Path(tempfile.mkstemp(prefix="bench-baseline-", suffix=".log")[1])
        cmd = [python, "-m", "bench.baseline_fastapi", "--port", "0", *extra]
        with log.open("wb") as f:
            popen = subprocess.Popen(
                cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=f, start_new_session=True
            )
        assert popen.stdout is not None
        line = popen.stdout.readline().decode().split()  # blocks until bound, or EOF on a crash
        if len(line) != 3 or line[0] != "LISTENING":
            popen.kill()
            raise RuntimeError(f"baseline did not start: {log.read_text()[-2000:]}")
        proc = cls("baseline", popen, line[1], int(line[2]), log)
        proc.wait_ready("/health", timeout_s)
        return proc

    def wait_ready(self, path: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.popen.returncode}):\n{self.log_tail()}"
                )
            if http_status(self.host, self.port, path) == 200:
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{self.name} not ready after {timeout_s:g}s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float:
        """CPU time of the server's main process, all its threads, children excluded.

        Linux's per-thread ``schedstat`` counts nanoseconds; ``/proc/PID/stat`` (what
        psutil reads) counts 10 ms ticks, too coarse for a few hundred requests. A thread
        that exits between two readings takes its time with it, so the ticks are the
        fallback only."""
        pid = self.popen.pid
        try:
            total = 0
            for task in Path(f"/proc/{pid}/task").iterdir():
                total += int((task / "schedstat").read_text().split()[0])
            return total / 1e9
        except (OSError, ValueError, IndexError):
            t = psutil.Process(pid).cpu_times()
            return float(t.user + t.system)

    def tree_cpu_seconds(self) -> float:
        """CPU seconds of the server and every process it spawned (10 ms ticks)."""
        root = psutil.Process(self.popen.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system
        return total

    def log_tail(self, n: int = 4000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after ``grace_s``."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
