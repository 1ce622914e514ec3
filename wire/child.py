"""Run a module as a child that dies with its parent:
``python -m wire.child [--supervised] MODULE ARGS``.

A supervised worker must not outlive the frontend that started it (a killed frontend
would otherwise leave a worker holding the device), nor a frontend the launcher of
``serve --frontends N`` (it would hold the port, answering 503, forever). On Linux the
kernel kills the child when its parent exits (``PR_SET_PDEATHSIG`` with SIGKILL: the
parent that could have stopped it gracefully is gone); elsewhere this is a plain
``python -m MODULE``.

``--supervised``: the child leaves its stop to its parent. Ctrl-C in a terminal
(SIGINT to the foreground process group) and a whole-group SIGTERM (systemd's
``KillMode=control-group``) reach every process of the server at once; a worker that
died of them would end every stream while its frontend was still draining. So the
supervised child ignores SIGINT and SIGTERM, and ends when its parent says so (a
worker: the SHUTDOWN frame after its frontend's drain) or dies.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import subprocess
import sys

__all__ = ["STOP_SIGNALS", "SUPERVISED", "main", "stop_process"]

_PR_SET_PDEATHSIG = 1
SUPERVISED = "--supervised"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # the ones a supervised child ignores


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:  # type: ignore[type-arg]
    """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL and reap."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main() -> None:
    parent = os.getppid()
    args = sys.argv[1:]
    if args and args[0] == SUPERVISED:
        args = args[1:]
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        raise SystemExit(1)
    module = args[0]
    sys.argv = [module, *args[1:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
