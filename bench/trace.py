"""Per-request cost of tracing, side by side with the state machine alone, in one run.

A request = create the record + validate, admit, dispatch, first_token, finish (the same
lifecycle as ``bench/fsm.py``). Rows:

- the FSM alone: no observer installed (the hook costs one global load and one ``if``);
- + tracer: the observer, the finished trace into the bounded ring, no feed subscriber;
- + tracer and trace log: also one JSON line per request (buffered file, rotated);
- + tracer and one feed subscriber: every edge kept for the feed, one message per tick
  (a tick every 100 requests here, ~ a busy server's 100 ms), encoded and queued.

Each row is the median of 5 timed repeats after one warm-up, in microseconds per request;
the overhead column is the difference from the FSM alone.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lifecycle.fsm import new_request  # noqa: E402
from lifecycle.states import Event  # noqa: E402
from lifecycle.tracing import TraceConfig, Tracer  # noqa: E402

PATH = (Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FIRST_TOKEN, Event.FINISH)
N = 10_000
TICK_EVERY = 100


def one_request() -> None:
    rec = new_request()
    for event in PATH:
        rec.fire(event)


def timed(fn: Callable[[], None], n: int, every: Callable[[], None] | None = None) -> float:
    runs = []
    for i in range(6):
        t0 = time.perf_counter_ns()
        for j in range(n):
            fn()
            if every is not None and j % TICK_EVERY == TICK_EVERY - 1:
                every()
        dt = time.perf_counter_ns() - t0
        if i:  # the first run is the warm-up
            runs.append(dt / n / 1000)
    return statistics.median(runs)


def with_tracer(config: TraceConfig, subscribe: bool = False) -> float:
    with Tracer(config) as tracer:
        if not subscribe:
            return timed(one_request, N, tracer.tick if config.log_path else None)
        stream = tracer.subscribe()
        sizes = []

        def tick() -> None:
            tracer.tick()
            while True:  # the subscriber keeps up: its queue never fills
                try:
                    sizes.append(len(stream.receive_nowait()))
                except Exception:
                    break

        try:
            return timed(one_request, N, tick)
        finally:
            stream.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = TraceConfig(log_path=str(Path(tmp) / "trace.jsonl"), log_max_bytes=16 << 20)
        rows = [
            ("FSM alone (no observer)", lambda: timed(one_request, N)),
            ("+ tracer: ring, feed with no subscriber", lambda: with_tracer(TraceConfig())),
            ("+ tracer and trace log (JSON line per request)", lambda: with_tracer(log)),
            ("+ tracer and one feed subscriber", lambda: with_tracer(TraceConfig(), True)),
        ]
        results = [(name, run()) for name, run in rows]
    base = results[0][1]
    print(f"{'per request (create + 5 edges)':<50} {'us/request':>10} {'overhead us':>12}")
    for name, us in results:
        print(f"{name:<50} {us:>10.2f} {us - base:>12.2f}")


if __name__ == "__main__":
    main()
