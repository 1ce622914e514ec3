"""Run a module as a child that dies with its parent: ``python -m wire.child MODULE ARGS``.

A supervised worker must not outlive the frontend that started it (a killed frontend
would otherwise leave a worker holding the device). On Linux the kernel delivers SIGTERM
to the child when its parent exits (``PR_SET_PDEATHSIG``); elsewhere this is a plain
``python -m MODULE``.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import subprocess
import sys

__all__ = ["main", "stop_process"]

_PR_SET_PDEATHSIG = 1


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
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        raise SystemExit(1)
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
