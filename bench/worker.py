"""The batch worker on the default model, driven over its socket like a frontend would.

Prints aggregate decode tokens/s at batch 1, 8, 32 and 64 (greedy, ignore_eos; timed from
the first step that decodes every sequence to the last), prefill tokens/s for a
512-token prompt, the batch-32 / batch-1 ratio, and the worker's CPU % while idle.
Runs in about a minute on a quiet 2-core machine.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from wire import (  # noqa: E402
    FrameBuffer,
    Hello,
    Shutdown,
    Step,
    Submit,
    SubmitEntry,
    decode_frame,
    encode_frame,
    frame_bytes,
    pack_ids,
)

BATCHES = (1, 8, 32, 64)
DECODE_TOKENS = 24
PROMPT = 512


class Client:
    def __init__(self, path: str) -> None:
        deadline = time.monotonic() + 300
        while True:
            try:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.connect(path)
                break
            except OSError:
                self.sock.close()
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        self.buf = FrameBuffer()
        self.frames: list = []
        assert isinstance(self.recv(), Hello)

    def recv(self):
        while not self.frames:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("worker closed the connection")
            self.frames += [decode_frame(p) for p in self.buf.feed(data)]
        return self.frames.pop(0)

    def run(self, rid0: int, prompts: list[list[int]], max_new: int) -> list[tuple[float, int]]:
        """Submit all, return (time, tokens) per step frame until every rid finished."""
        s = {"temperature": 0, "ignore_eos": True, "max_new_tokens": max_new}
        entries = [SubmitEntry(rid0 + i, pack_ids(p), s, {}) for i, p in enumerate(prompts)]
        self.sock.sendall(frame_bytes(encode_frame(Submit(entries))))
        left, marks = len(prompts), [(time.perf_counter(), 0)]
        while left:
            f = self.recv()
            if isinstance(f, Step):
                marks.append((time.perf_counter(), sum(len(e.new_ids) // 4 for e in f.entries)))
                left -= sum(1 for e in f.entries if e.finish is not None)
        return marks


def decode_rate(marks: list[tuple[float, int]], batch: int) -> float:
    """Tokens/s over the steps after the first one in which all ``batch`` sequences decoded."""
    start = next(i for i, (_, n) in enumerate(marks) if n == batch)
    toks = sum(n for _, n in marks[start + 1 :])
    return toks / (marks[-1][0] - marks[start][0])


def main() -> int:
    path = os.path.join(tempfile.mkdtemp(), "w.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu.worker", "--listen", f"unix:{path}"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stderr=subprocess.DEVNULL,
    )
    try:
        c = Client(path)
        c.run(1, [[1, 2, 3]], 4)  # warm-up
        rates = {}
        rid = 100
        for b in BATCHES:
            prompts = [[1] + [1000 + 37 * i + j for j in range(15)] for i in range(b)]
            rates[b] = decode_rate(c.run(rid, prompts, DECODE_TOKENS), b)
            rid += b
            print(f"decode batch {b:3d}: {rates[b]:7.1f} tokens/s aggregate", flush=True)
        marks = c.run(rid, [[1] + [2000 + j for j in range(PROMPT - 1)]], 1)
        print(f"prefill {PROMPT} tokens: {PROMPT / (marks[-1][0] - marks[0][0]):7.1f} tokens/s")
        print(f"batch-32 / batch-1 ratio: {rates[32] / rates[1]:.1f}")
        p = psutil.Process(proc.pid)
        p.cpu_percent(None)
        time.sleep(2.0)
        print(f"idle CPU: {p.cpu_percent(None):.1f} % of one core")
        c.sock.sendall(frame_bytes(encode_frame(Shutdown())))
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
