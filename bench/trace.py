"""Per-request cost of tracing, side by side with the state machine alone, in one run.

A request = create the record + validate, admit, dispatch, first_token, finish (the same
lifecycle as ``bench/fsm.py``). Rows:

- the FSM alone: no observer installed (the hook costs one global load and one ``if``);
- + tracer: the observer, the finished trace into the bounded ring, no feed subscriber;
- + tracer and trace log: also one JSON line per request (buffered file, rotated);
- + tracer and one feed subscriber: every edge kept for the feed, one message per tick
  (a tick every 100 requests here, ~ a busy server's 100 ms), encoded and queued.

Rows run interleaved, 7 rounds after a warm-up round; each figure is the median, in
microseconds per request;
the overhead column is the difference from the FSM alone.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lifecycle.core.fsm import new_request  # noqa: E402
from lifecycle.core.states import Event  # noqa: E402
from lifecycle.tracing.tracer import TraceConfig, Tracer  # noqa: E402

PATH = (Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FIRST_TOKEN, Event.FINISH)
N = 5_000
ROUNDS = 7
TICK_EVERY = 100


def one_request() -> None:
    rec = new_request()
    for event in PATH:
        rec.fire(event)


def timed_block(n: int, every: Callable[[], None] | None) -> float:
    t0 = time.perf_counter_ns()
    for j in range(n):
        one_request()
        if every is not None and j % TICK_EVERY == TICK_EVERY - 1:
            every()
    return (time.perf_counter_ns() - t0) / n / 1000


@contextmanager
def fsm_alone() -> Iterator[Callable[[], None] | None]:
    yield None


@contextmanager
def traced(config: TraceConfig, subscribe: bool = False) -> Iterator[Callable[[], None] | None]:
    with Tracer(config) as tracer:
        if not subscribe:
            yield tracer.tick if config.log_path else None
            return
        with tracer.subscribe() as stream:

            def tick() -> None:
                tracer.tick()
                while True:  # the subscriber keeps up: its queue never fills
                    try:
                        stream.receive_nowait()
                    except anyio.WouldBlock:
                        break

            yield tick


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = TraceConfig(log_path=str(Path(tmp) / "trace.jsonl"), log_max_bytes=16 << 20)
        rows: list[tuple[str, Callable[[], Any]]] = [
            ("FSM alone (no observer)", fsm_alone),
            ("+ tracer: ring, feed with no subscriber", lambda: traced(TraceConfig())),
            ("+ tracer and trace log (JSON line per request)", lambda: traced(log)),
            ("+ tracer and one feed subscriber", lambda: traced(TraceConfig(), True)),
        ]
        # Rows interleave round by round, so load from other processes hits them alike.
        samples: dict[str, list[float]] = {name: [] for name, _ in rows}
        for round in range(ROUNDS + 1):
            for name, setup in rows:
                with setup() as every:
                    us = timed_block(N, every)
                if round:  # the first round is the warm-up
                    samples[name].append(us)
    base = statistics.median(samples[rows[0][0]])
    print(f"{'per request (create + 5 edges)':<50} {'us/request':>10} {'overhead us':>12}")
    for name, _ in rows:
        us = statistics.median(samples[name])
        print(f"{name:<50} {us:>10.2f} {us - base:>12.2f}")


if __name__ == "__main__":
    main()
