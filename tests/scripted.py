"""Helpers to run the scripted worker (``lifecycle.scripted_worker``) as a real process."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def scripted_worker_argv(address: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "lifecycle.scripted_worker", "--listen", address, *args]


@contextmanager
def scripted_worker(*args: str) -> Iterator[str]:
    """Start a scripted worker on a Unix socket; yields its address."""
    with tempfile.TemporaryDirectory(prefix="lc-sw-") as tmp:
        path = os.path.join(tmp, "w.sock")
        proc = subprocess.Popen(scripted_worker_argv(f"unix:{path}", *args), cwd=ROOT)
        try:
            deadline = time.monotonic() + 20
            while not os.path.exists(path):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("scripted worker did not start")
                time.sleep(0.02)
            yield f"unix:{path}"
        finally:
            proc.kill()
            proc.wait()
