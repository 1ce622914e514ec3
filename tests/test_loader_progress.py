"""Model loading shows its progress on a terminal (MiB of the GGUF's tensors read) and
nothing when stderr is not one: the real worker on a tiny GGUF, its stderr on a pty."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from .tiny_gguf import TinyModel

ROOT = Path(__file__).resolve().parent.parent


def _worker(tiny: TinyModel, sock: Path, stderr: int) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "gpu.worker", "--listen", f"unix:{sock}",
            "--model", str(tiny.path), "--device", "cpu"]  # fmt: skip
    return subprocess.Popen(argv, cwd=ROOT, stderr=stderr, stdout=subprocess.DEVNULL)


def test_progress_on_a_terminal_and_not_elsewhere(tiny_gguf: TinyModel, tmp_path: Path) -> None:
    master, slave = pty.openpty()
    proc = _worker(tiny_gguf, tmp_path / "a.sock", slave)
    os.close(slave)
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"(100 %)" not in seen and time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # the worker closed its end
                    break
    finally:
        proc.kill()
        proc.wait()
        os.close(master)
    text = seen.decode(errors="replace")
    assert f"loading {tiny_gguf.path.name}:" in text and "MiB (100 %)" in text, text[-500:]

    proc = _worker(tiny_gguf, tmp_path / "b.sock", subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "b.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert b"loaded" in err and b"loading " not in err  # the log line, no progress line
