"""A blocking test client for the worker process: spawn it, send frames, collect outputs.

Every frame the worker sends is validated against ``specs/wire.cddl``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.wire_schema import validate_frame
from wire import (
    Frame,
    FrameBuffer,
    Hello,
    ReqError,
    Step,
    StepEntry,
    Submit,
    SubmitEntry,
    decode_frame,
    encode_frame,
    frame_bytes,
    ids_to_list,
    pack_ids,
)

__all__ = ["Result", "WorkerClient", "served_worker", "spawn_worker"]

ROOT = Path(__file__).resolve().parent.parent


def spawn_worker(sock_path: str, *args: str) -> subprocess.Popen[bytes]:
    """Start ``python -m gpu.worker``; its log goes to ``<sock_path>.log``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    with open(sock_path + ".log", "wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "gpu.worker", "--listen", f"unix:{sock_path}", *args],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@contextmanager
def served_worker(sock_path: str, *args: str, timeout: float = 120) -> Iterator[WorkerClient]:
    """A worker process and a client connected to it; the worker must still be up when
    the block ends, and is killed then."""
    proc = spawn_worker(sock_path, *args)
    try:
        c = WorkerClient(sock_path, timeout=timeout)
        yield c
        c.close()
        assert proc.poll() is None, "the worker died"
    finally:
        proc.kill()
        proc.wait()


@dataclass
class Result:
    rid: int
    ids: list[int] = field(default_factory=list)
    finish: list[Any] | None = None
    error: tuple[str, str] | None = None
    extras: list[dict[str, Any]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish is not None or self.error is not None


class WorkerClient:
    def __init__(self, sock_path: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(sock_path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.sock.settimeout(timeout)
        self.buf = FrameBuffer()
        self.pending: list[Frame] = []
        self.frames: list[Frame] = []  # every frame received, in order
        hello = self.recv()
        assert isinstance(hello, Hello), hello
        self.hello = hello
        self.results: dict[int, Result] = {}

    def send(self, frame: Frame) -> None:
        self.sock.sendall(frame_bytes(encode_frame(frame)))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self) -> Frame | None:
        """Next frame, or None at EOF."""
        while not self.pending:
            try:
                data = self.sock.recv(1 << 20)
            except ConnectionResetError:
                data = b""
            if not data:
                return None
            for payload in self.buf.feed(data):
                validate_frame(payload)
                self.pending.append(decode_frame(payload))
        frame = self.pending.pop(0)
        self.frames.append(frame)
        return frame

    def submit(
        self,
        rid: int,
        prompt: list[int],
        sampling: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.submit_many([(rid, prompt, sampling or {}, options or {})])

    def submit_many(
        self, reqs: list[tuple[int, list[int], dict[str, Any], dict[str, Any]]]
    ) -> None:
        n_total = 0
        for rid, _, sampling, _ in reqs:
            n = sampling.get("n", 1) if isinstance(sampling.get("n", 1), int) else 1
            for r in range(rid, rid + max(n, 1)):
                self.results[r] = Result(r)
            n_total += 1
        self.send(Submit([SubmitEntry(r, pack_ids(p), s, o) for r, p, s, o in reqs]))

    def apply(self, frame: Frame) -> None:
        if isinstance(frame, Step):
            for e in frame.entries:
                self._entry(e)
        elif isinstance(frame, ReqError):
            for rid, code, msg in frame.errors:
                r = self.results.setdefault(rid, Result(rid))
                assert not r.done, f"second terminal for {rid}"
                r.error = (code, msg)

    def _entry(self, e: StepEntry) -> None:
        r = self.results.setdefault(e.rid, Result(e.rid))
        assert not r.done, f"entry after terminal for {e.rid}"
        r.ids += ids_to_list(e.new_ids)
        if e.extra:
            r.extras.append(e.extra)
        r.finish = e.finish

    def wait(self, rids: list[int] | None = None, until: Any = None) -> dict[int, Result]:
        """Receive until every rid (default: all submitted) is done, or ``until(frame)``."""
        want = list(self.results) if rids is None else rids
        while not all(self.results[r].done for r in want):
            frame = self.recv()
            assert frame is not None, "worker closed the connection"
            self.apply(frame)
            if until is not None and until(frame):
                break
        return {r: self.results[r] for r in want}

    def request(self, frame: Frame, kind: type) -> Any:
        """Send a control frame and wait for its reply (applying step frames meanwhile)."""
        self.send(frame)
        while True:
            got = self.recv()
            assert got is not None, "worker closed the connection"
            if isinstance(got, kind):
                return got
            self.apply(got)

    def close(self) -> None:
        self.sock.close()
