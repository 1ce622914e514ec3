"""``lifecycle serve --frontends N``: N frontend processes on one port, sharing the workers.

One Python frontend is one core (``bench/frontend_paced.py``); past it, more frontends
serve the same workers. This process starts the workers itself (``--dp`` of them; none
with ``--worker``: the frontends use those) on Unix sockets in a private folder, then N
frontends, each a ``lifecycle serve`` of its own with the same options, ``--reuse-port``
(the kernel spreads connections among the listeners of one port, SO_REUSEPORT) and
``--worker`` for each worker. A worker serves every frontend at once, each frontend's
requests on its own connection (``gpu/worker/process.py``), so a frontend that dies ends only its
own requests (the worker frees what that connection held); this process starts it
again, and a worker that dies is started again the same way while the frontends
reconnect to it. SIGTERM or SIGINT: the frontends drain and stop, then the workers.

What is per frontend: each keeps its own requests, so ``/metrics``, ``/debug``,
``/server_info`` and the trace ring describe the frontend that answered (each says which
in ``/server_info``: ``frontend_index`` and ``frontend_pid``); the workers' state in
them is whole.
To see all of them, scrape each frontend (``--trace-log`` with a file per frontend:
``{frontend}`` in the path is its index). docs/scaling.md, "Several frontends on one port".
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lifecycle.link.supervisor import REFUSED_STATUS
from lifecycle.runtime import (
    FRONTEND_INDEX_ENV,
    FRONTENDS_DIR_ENV,
    AppConfig,
    worker_addresses,
    worker_args,
)
from wire.child import SUPERVISED

__all__ = ["CHILD_CUT", "CHILD_DRAIN", "child_argv", "run_frontends"]

log = logging.getLogger("lifecycle.frontends")
# How the launcher of serve --frontends N stops its frontends: drain, then (its second
# signal) cut. A frontend under it ignores SIGINT and a repeated SIGTERM: Ctrl-C and a
# group SIGTERM reach the launcher too, which drains them all at once.
CHILD_DRAIN = signal.SIGTERM
CHILD_CUT = signal.SIGUSR1
_RESTART_S = 0.5  # the least time between two starts of one process
_DRAIN_GRACE_S = 5.0  # past a frontend's --drain-timeout: its cut, its close, its exit


def child_argv(serve_argv: list[str], workers: list[str], spawned: bool) -> list[str]:
    """A frontend's command: the same options, one frontend, the shared port, and the
    workers this process started (``--dp 0``: it spawns none of its own). It runs under
    ``wire.child``: it dies with this process, so no orphan keeps the port."""
    argv = [sys.executable, "-m", "wire.child", "lifecycle", "serve", *serve_argv]
    argv += ["--frontends", "1"]
    argv += ["--reuse-port"]
    if spawned:
        argv += ["--dp", "0"]
        for address in workers:
            argv += ["--worker", address]
    return argv


class _Child:
    """One process this launcher keeps running."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.argv, self.env = name, argv, env
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.starts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env)
        self.started, self.starts = time.monotonic(), self.starts + 1
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    def check(self) -> None:
        """Start it again if it ended (at most once every ``_RESTART_S``)."""
        if self.proc is None or self.proc.poll() is None:
            return
        if time.monotonic() - self.started < _RESTART_S:
            return
        log.warning("%s ended with status %s; starting it again", self.name, self.proc.returncode)
        self.start()

    def signal(self, signum: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def wait(self, deadline: float) -> bool:
        """Reaped by ``deadline`` (monotonic seconds)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()


def _refused(*groups: list[_Child]) -> _Child | None:
    """A child that exited with status 2: it refused its options or model (a worker) or
    its start-up (a frontend), and is not started again."""
    for child in (c for group in groups for c in group):
        if child.proc is not None and child.proc.poll() == REFUSED_STATUS:
            return child
    return None


def _stop_frontends(frontends: list[_Child], drain_timeout: float, signals: list[int]) -> None:
    """Every frontend drains at once (``CHILD_DRAIN``), so each refuses new requests
    from the signal on and the whole stop takes one drain; a second signal here cuts
    them all (``CHILD_CUT``). Past the drain and its grace, what is left is killed."""
    for child in frontends:
        child.signal(CHILD_DRAIN)
    seen = len(signals)
    deadline = time.monotonic() + drain_timeout + _DRAIN_GRACE_S
    while time.monotonic() < deadline:
        if all(child.wait(time.monotonic() + 0.1) for child in frontends):
            return
        if len(signals) > seen:
            seen = len(signals)
            log.warning("second signal: the frontends end their requests now")
            for child in frontends:
                child.signal(CHILD_CUT)
            deadline = min(deadline, time.monotonic() + _DRAIN_GRACE_S)
    log.error("frontends still running past the drain: killing them")


def run_frontends(cfg: AppConfig, serve_argv: list[str]) -> int:
    """Run the workers and ``cfg.frontends`` frontends until SIGTERM or SIGINT; 2 when
    the frontends would share one trace log."""
    if cfg.trace.log_path and "{frontend}" not in cfg.trace.log_path:
        print("error: --trace-log with --frontends needs {frontend} in the path (each "
              "frontend writes its own file)", file=sys.stderr)  # fmt: skip
        return 2
    folder = Path(tempfile.mkdtemp(prefix="lifecycle-frontends-"))
    workers = list(worker_addresses(cfg))
    spawned = not workers
    children: list[_Child] = []
    if spawned:
        for k in range(cfg.dp or 1):
            address = f"unix:{folder / f'worker{k}.sock'}"
            argv = [sys.executable, "-m", "wire.child", SUPERVISED, cfg.worker_module]
            argv += ["--listen", address]
            children.append(_Child(f"worker {k}", [*argv, *worker_args(cfg)], dict(os.environ)))
            workers.append(address)
    frontends = []
    for i in range(cfg.frontends):
        env = {**os.environ, FRONTEND_INDEX_ENV: str(i), FRONTENDS_DIR_ENV: str(folder)}
        frontends.append(_Child(f"frontend {i}", child_argv(serve_argv, workers, spawned), env))
    stopping: list[int] = []
    code, refused = 0, None
    previous = {s: signal.signal(s, lambda signum, _f: stopping.append(signum))
                for s in (signal.SIGTERM, signal.SIGINT)}  # fmt: skip
    try:
        for child in children:
            child.start()
        # A worker listens once it took its options and device (before its model loads):
        # the frontends bind the port only then, so a refusal leaves the port unbound.
        sockets = [Path(a.removeprefix("unix:")) for a in workers] if spawned else []
        while not stopping and not all(p.exists() for p in sockets):
            if (refused := _refused(children)) is not None:
                break
            time.sleep(0.05)
        if refused is None:
            for child in frontends:
                child.start()
            log.info("%d frontends on port %d, %d workers", len(frontends), cfg.port, len(workers))
        while not stopping and refused is None:
            time.sleep(0.1)
            if (refused := _refused(children, frontends)) is None:
                for child in (*children, *frontends):
                    child.check()
        if refused is not None:  # it said why in one line; starting it again would too
            log.error("%s refused to start (status 2): stopping", refused.name)
            code = 2
        _stop_frontends(frontends, cfg.drain_timeout, stopping)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in frontends:  # an exception above: none is left behind
            child.kill()
        for child in children:  # supervised: they ignore SIGTERM, and hold nothing now
            child.kill()
        for path in [*folder.glob("*.sock"), *folder.glob("metrics-*")]:
            path.unlink(missing_ok=True)
        folder.rmdir()
    return code
