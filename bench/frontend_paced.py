"""The frontend at a GPU's pace: streamed tokens/s it delivers, its CPU per token, ITL.

The scripted worker (no model) emits one token for every running stream each
``--pace-ms`` (4 ms: a GPU decode step at a few hundred streams), so the stream count
sets the offered load: ``streams * 1000 / pace_ms`` tokens/s. For each ``--streams``
level this opens that many streamed ``/generate`` requests at once (incremental SSE,
``--tokens`` each) from a raw asyncio client (a few microseconds a chunk, so the client
is not the limit the way an HTTP library would be), and prints:

- delivered tokens/s (``--tokens`` for each stream that ended with ``[DONE]``, over the
  time from the first event to the last);
- the frontend's CPU per token (its process alone, children excluded: the worker runs
  as its child) and the tokens/s that makes per frontend core (1e6 / us per token);
- the frontend's share of a core during the phase, events per token (a stream whose
  reader lags gets the tokens that waited in one event), and ITL p50 / p99 at the
  client: the gap between consecutive events of one stream, against the pace.

Issue 39's figure: >= 50,000 tokens/s per frontend core at ITL p99 <= 2x the pace.
The frontend keeps the pace while its core share stays under 1; past it, the ITL grows.
On a 2-core machine the client and the worker take their share of the same cores.

    python bench/frontend_paced.py [--streams 64 256 1024] [--pace-ms 4] [--tokens 128]
    python bench/frontend_paced.py --baseline REV     # this tree and REV, A B A B
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.frontend import _checkout, _cpu, serve  # noqa: E402

_MARK = b"data: {"  # one SSE event with tokens (the last event is "data: [DONE]")
_DONE = b"data: [DONE]"


class _Stream(asyncio.Protocol):
    """One streamed request on its own connection: the arrival time of each event."""

    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self.request, self.done = request, done
        self.times: list[float] = []
        self.tail = b""
        self.status = b""
        self.complete = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        if not self.status:
            self.status = data[9:12]
        buf = self.tail + data
        self.times.extend([now] * buf.count(_MARK))
        self.complete = self.complete or _DONE in buf
        self.tail = buf[-(len(_DONE) - 1) :]  # a mark split across reads counts once

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def _run_streams(port: int, streams: int, tokens: int) -> list[_Stream]:
    loop = asyncio.get_running_loop()
    out: list[_Stream] = []
    waits = []
    for i in range(streams):
        body = json.dumps({
            "input_ids": [100 + i % 1000, 7, 8, 9],
            "stream": True,
            "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True},
        }).encode()  # fmt: skip
        head = (f"POST /generate HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()  # fmt: skip
        done: asyncio.Future[None] = loop.create_future()
        stream = _Stream(head + body, done)
        await loop.create_connection(lambda s=stream: s, "127.0.0.1", port)  # type: ignore[misc]
        out.append(stream)
        waits.append(done)
        if i % 64 == 63:
            await asyncio.sleep(0)  # let the listener keep up with the connects
    await asyncio.wait_for(asyncio.gather(*waits), timeout=600)
    return out


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _phase(proc: psutil.Process, port: int, streams: int, tokens: int) -> dict[str, float]:
    c0 = _cpu(proc)
    t0 = time.perf_counter()
    got = asyncio.run(_run_streams(port, streams, tokens))
    wall = time.perf_counter() - t0
    cpu = _cpu(proc) - c0
    bad = sum(1 for s in got if s.status != b"200" or not s.complete)
    counted = tokens * (len(got) - bad)
    events = sum(len(s.times) for s in got)
    first = min((s.times[0] for s in got if s.times), default=t0)
    last = max((s.times[-1] for s in got if s.times), default=t0)
    gaps = [b - a for s in got for a, b in zip(s.times, s.times[1:], strict=False)]
    return {
        "streams": streams,
        "tokens": counted,
        "expected": streams * tokens,
        "failed": bad,
        "events_per_token": events / max(counted, 1),
        "tps": counted / max(last - first, 1e-9),
        "us_per_token": cpu / max(counted, 1) * 1e6,
        "core_share": cpu / wall,
        "itl_p50_ms": _percentile(gaps, 0.5) * 1e3,
        "itl_p99_ms": _percentile(gaps, 0.99) * 1e3,
    }


def _measure(root: Path, args: argparse.Namespace) -> list[dict[str, float]]:
    top = max(args.streams)
    blocks = top * -(-(4 + args.tokens + 16) // 16)
    worker = (f"--step-delay {args.pace_ms / 1e3} --burst 1 --max-running {top} "
              f"--max-pending {top} --kv-blocks {blocks}")  # fmt: skip
    extra = ("--incremental-streaming-output", "--max-queued", str(top), "--worker-args", worker)
    with serve(root, extra) as (proc, url):
        port = int(url.rsplit(":", 1)[1])
        _phase(proc, port, min(16, top), 8)  # warm-up
        return [_phase(proc, port, s, args.tokens) for s in args.streams]


def _report(results: dict[str, list[list[dict[str, float]]]], args: argparse.Namespace) -> None:
    print(f"scripted worker: one token per stream every {args.pace_ms:g} ms, {args.tokens} "
          f"tokens a stream; medians of {len(next(iter(results.values())))} run(s), each "
          f"run's after it")  # fmt: skip
    rows = [
        ("delivered tokens/s", "tps", "{:.0f}"),
        ("frontend CPU per token, us", "us_per_token", "{:.1f}"),
        ("tokens/s per frontend core", "per_core", "{:.0f}"),
        ("frontend core share", "core_share", "{:.2f}"),
        ("events per token", "events_per_token", "{:.2f}"),
        ("ITL p50, ms", "itl_p50_ms", "{:.1f}"),
        ("ITL p99, ms", "itl_p99_ms", "{:.1f}"),
    ]
    for i, streams in enumerate(args.streams):
        offered = streams * 1000 / args.pace_ms
        print(f"\n{streams} streams (offered {offered:,.0f} tokens/s; ITL goal <= "
              f"{2 * args.pace_ms:g} ms)")  # fmt: skip
        print("figure".ljust(30) + "".join(n.rjust(30) for n in results))
        for label, key, fmt in rows:
            cells = []
            for runs in results.values():
                vals = [1e6 / r[i]["us_per_token"] if key == "per_core" else r[i][key]
                        for r in runs]  # fmt: skip
                each = "/".join(fmt.format(v) for v in vals)
                cells.append(f"{fmt.format(statistics.median(vals))} ({each})".rjust(30))
            print(label.ljust(30) + "".join(cells))
        for name, runs in results.items():
            for r in (r[i] for r in runs if r[i]["failed"]):
                print(f"  {name}: {r['failed']:.0f} of {streams} streams did not end well")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    p.add_argument("--pace-ms", type=float, default=4.0)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--baseline", default=None, help="a git ref to measure side by side")
    p.add_argument("--reps", type=int, default=1, help="A B rounds")
    args = p.parse_args()
    trees: dict[str, Path] = {"this tree": ROOT}
    with tempfile.TemporaryDirectory(prefix="lc-baseline-") as tmp:
        if args.baseline is not None:
            trees[f"baseline {args.baseline}"] = _checkout(args.baseline, Path(tmp))
        results: dict[str, list[Any]] = {name: [] for name in trees}
        for _ in range(args.reps):
            for name, tree in trees.items():
                results[name].append(_measure(tree, args))
    _report(results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
