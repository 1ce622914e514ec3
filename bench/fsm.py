"""Per-request lifecycle cost of the request state machine, three ways, in one run.

A lifecycle = create the request + validate, admit, dispatch, first_token, finish.
Rows: our RequestRecord (compiled table + trace entries), the same plus registry
add/remove, a naive shared ``transitions`` Machine (add_model, 5 triggers, remove_model:
the library's documented pattern), and a bare dict table with no trace. Each row is the
median of 5 timed repeats after one warm-up, reported in microseconds per lifecycle.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transitions import Machine  # noqa: E402

from lifecycle.core.fsm import new_request  # noqa: E402
from lifecycle.core.registry import Registry  # noqa: E402
from lifecycle.core.states import EDGES, INITIAL, Event, State  # noqa: E402

PATH = (Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FIRST_TOKEN, Event.FINISH)
N = 20_000


def ours() -> None:
    rec = new_request()
    for event in PATH:
        rec.fire(event)


_registry = Registry()


def ours_with_registry() -> None:
    rec = new_request()
    _registry.add(rec)
    for event in PATH:
        rec.fire(event)
    _registry.remove(rec)


_naive = Machine(
    model=None,
    states=[s.value for s in State],
    transitions=[
        {"trigger": e.event.value, "source": e.src.value, "dest": e.dst.value} for e in EDGES
    ],
    initial=INITIAL.value,
    auto_transitions=False,
)
_NAMES = [e.value for e in PATH]


class _Model:
    pass


def naive_transitions() -> None:
    model = _Model()
    _naive.add_model(model)
    for name in _NAMES:
        model.trigger(name)
    _naive.remove_model(model)


_TABLE = {(e.src, e.event): e.dst for e in EDGES}


class _Bare:
    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = INITIAL


def bare_dict() -> None:
    obj = _Bare()
    for event in PATH:
        obj.state = _TABLE[(obj.state, event)]


def per_call_us(fn: Callable[[], None], n: int) -> float:
    runs = []
    for i in range(6):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        dt = time.perf_counter_ns() - t0
        if i:  # the first run is the warm-up
            runs.append(dt / n / 1000)
    return statistics.median(runs)


def main() -> None:
    rows = [
        ("lifecycle RequestRecord (compiled table, traced)", ours, N),
        ("lifecycle RequestRecord + Registry add/remove", ours_with_registry, N),
        ("naive shared transitions Machine (add/remove_model)", naive_transitions, N // 10),
        ("bare dict table (no trace, no guards)", bare_dict, N),
    ]
    print(f"{'pattern':<56} {'us/lifecycle':>12}")
    for name, fn, n in rows:
        print(f"{name:<56} {per_call_us(fn, n):>12.2f}")


if __name__ == "__main__":
    main()
