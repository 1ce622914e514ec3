"""The batch worker on the default model, driven over its socket like a frontend would.

Prints aggregate decode tokens/s at batch 1, 8, 32 and 64 (greedy, ignore_eos; timed from
the first step that decodes every sequence to the last), prefill tokens/s for a
512-token prompt, the batch-32 / batch-1 ratio, and the worker's CPU % and RSS while idle
after the load. Then, unless ``--no-baseline``, the same on a second worker configured as
before the CPU tuning and the C decode attention (passive OpenMP, torch attention), and a
table of both side by side with their ratio. Last, when llama.cpp's llama-server is built
(``make bench-peer``; ``--llama-server PATH`` to point elsewhere), its RSS idle after
loading the same model with bench/compare.py's start flags, beside ours. About two
minutes on a quiet 2-core machine.
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

from bench import llama_server  # noqa: E402
from bench.procs import free_port  # noqa: E402
from modelfile.gguf_file import default_model_path  # noqa: E402
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


# The configuration before the worker's CPU tuning (gpu/kernels/cpu_runtime.py) and the C decode
# attention (gpu/kernels/native.py): the baseline run next to the current one.
BASELINE_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "LIFECYCLE_NATIVE": "0"}


def measure(env: dict[str, str], label: str) -> dict[str, float]:
    """Start a worker with ``env``, run the whole measurement, shut it down."""
    path = os.path.join(tempfile.mkdtemp(), "w.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpu.worker", "--listen", f"unix:{path}"],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), **env),
        stderr=subprocess.DEVNULL,
    )
    out: dict[str, float] = {}
    try:
        c = Client(path)
        c.run(1, [[1, 2, 3]], 4)  # warm-up
        rid = 100
        for b in BATCHES:
            prompts = [[1] + [1000 + 37 * i + j for j in range(15)] for i in range(b)]
            out[f"decode batch {b}"] = decode_rate(c.run(rid, prompts, DECODE_TOKENS), b)
            rid += b
            print(
                f"[{label}] decode batch {b:3d}: {out[f'decode batch {b}']:7.1f} tokens/s",
                flush=True,
            )
        marks = c.run(rid, [[1] + [2000 + j for j in range(PROMPT - 1)]], 1)
        out[f"prefill {PROMPT}"] = PROMPT / (marks[-1][0] - marks[0][0])
        out["batch-32 / batch-1"] = out["decode batch 32"] / out["decode batch 1"]
        p = psutil.Process(proc.pid)
        p.cpu_percent(None)
        time.sleep(2.0)
        out["idle CPU %"] = p.cpu_percent(None)
        out["idle RSS MiB"] = p.memory_info().rss / 2**20
        c.sock.sendall(frame_bytes(encode_frame(Shutdown())))
        proc.wait(timeout=30)
        return out
    finally:
        if proc.poll() is None:
            proc.kill()


def peer_rss(explicit: str | None) -> float | None:
    """llama-server's RSS in MiB, idle after loading the default model; None (with the
    note saying how to build it) when its binary is absent."""
    binary = llama_server.binary_path(explicit)
    note = llama_server.skip_note(binary)
    if note:
        print(note)
        return None
    proc = llama_server.start(binary, str(default_model_path()), free_port())
    try:
        time.sleep(2.0)  # /health is 200 once loaded; let the threads settle
        return llama_server.rss_mib(proc.popen.pid)
    finally:
        proc.stop()


def main() -> int:
    argv = sys.argv[1:]
    baseline = "--no-baseline" not in argv
    explicit = argv[argv.index("--llama-server") + 1] if "--llama-server" in argv else None
    runs = {"current": measure({}, "current")}
    if baseline:
        runs["baseline"] = measure(BASELINE_ENV, "baseline")
    print()
    print("figure                      " + "".join(f"{k:>12}" for k in runs), end="")
    print(f"{'ratio':>8}" if baseline else "")
    for key in runs["current"]:
        unit = "" if key.endswith(("%", "batch-1", "MiB")) else " tok/s"
        row = f"{key + unit:<28}" + "".join(f"{r[key]:12.1f}" for r in runs.values())
        if baseline and runs["baseline"][key]:
            row += f"{runs['current'][key] / runs['baseline'][key]:8.2f}"
        print(row)
    if baseline:
        print(f"baseline = {' '.join(f'{k}={v}' for k, v in BASELINE_ENV.items())}")
    peer = peer_rss(explicit)
    if peer is not None:
        ours = runs["current"]["idle RSS MiB"]
        print(
            f"idle RSS after load, MiB: our worker {ours:.0f}, llama-server {peer:.0f} "
            f"(--parallel {llama_server.PARALLEL}, ctx {llama_server.CTX_SIZE}); "
            f"ours/llama-server {ours / peer:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
