"""An asyncio event loop with virtual time and a seeded schedule.

``SimLoop`` never sleeps and never polls a socket: when nothing is ready its clock jumps
to the next timer, and each pass runs the ready callbacks in an order drawn from
``random.Random(seed)`` instead of first-in first-out. The same seed therefore replays the
same interleaving of every task (the server's, the worker's, the clients'), down to the
order in which two wake-ups in the same pass run. anyio runs on it through
``anyio.run(..., backend_options={"loop_factory": ...})``.

The product reads clocks of its own (``time.monotonic`` for transport deadlines, the
hung-worker watchdog, trace timestamps). ``virtual_clock`` points the ``time`` name of
every ``lifecycle``/``transport``/``wire`` module at a stand-in whose clocks are the
running ``SimLoop``'s, and makes ``uuid.uuid4`` seeded, for the length of a run: what the
product measures is what the loop schedules, and generated ids replay too. Tasks and
anyio's cancel scopes hash by creation number, not address, so that the sets anyio
keeps them in iterate in an order that replays from one process to the next.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import sys
import time as _time
import uuid
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from anyio._backends import _asyncio as _anyio_asyncio

__all__ = ["SimDeadlock", "SimLoop", "virtual_clock"]

_EPOCH = 1_767_225_600.0  # 2026-01-01T00:00:00Z: wall clocks start here in a simulation


class SimDeadlock(RuntimeError):
    """Nothing is ready and no timer is set: every task waits on something that never comes."""


class _ShuffledReady(deque[Any]):
    """The loop's ready queue; ``popleft`` takes a seeded random entry, not the first."""

    __slots__ = ("rng",)

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.rng = rng

    def popleft(self) -> Any:
        n = len(self)
        if n > 1:
            k = int(self.rng.random() * n)
            if k:
                item = self[k]
                del self[k]
                return item
        return super().popleft()


class _VirtualSelector:
    """Stands in for the selector: a poll with a timeout is the clock jumping ahead."""

    def __init__(self, loop: SimLoop) -> None:
        self.loop = loop

    def select(self, timeout: float | None) -> list[Any]:
        if timeout is None:
            raise SimDeadlock("nothing ready and no timer set")
        if timeout > 0:
            self.loop.now += timeout
        return []

    def close(self) -> None:
        pass


class _SimTask(asyncio.Task):  # type: ignore[type-arg]
    """A task whose hash is its creation number: sets of tasks (anyio keeps the tasks of
    a cancel scope in one) then iterate in an order that replays, not in address order."""

    def __init__(self, coro: Any, *, loop: SimLoop, **kwargs: Any) -> None:
        self._sim_n = next(loop.numbers)  # before __init__: it files the task in a set
        super().__init__(coro, loop=loop, **kwargs)

    def __hash__(self) -> int:
        return self._sim_n


class _SimCancelScope(_anyio_asyncio.CancelScope):
    """anyio's cancel scope, hashed by creation number for the same reason (a scope
    delivers a cancellation to its child scopes in the order of a set)."""

    __slots__ = ("_sim_n",)

    def __init__(self, deadline: float = math.inf, shield: bool = False) -> None:
        super().__init__(deadline=deadline, shield=shield)
        loop = asyncio._get_running_loop()
        self._sim_n = next(loop.numbers) if isinstance(loop, SimLoop) else id(self)

    def __hash__(self) -> int:
        return self._sim_n


class SimLoop(asyncio.BaseEventLoop):
    """Virtual time, a seeded choice of the next ready callback, no I/O at all."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.now = 0.0
        self.passes = 0
        self.numbers = itertools.count(1)
        self.set_task_factory(lambda loop, coro, **kw: _SimTask(coro, loop=loop, **kw))
        self.rng = random.Random(seed)
        self._ready = _ShuffledReady(self.rng)  # type: ignore[assignment]
        self._selector = _VirtualSelector(self)  # type: ignore[attr-defined]
        self._clock_resolution = 1e-9

    def time(self) -> float:
        return self.now

    def _run_once(self) -> None:
        self.passes += 1
        super()._run_once()  # type: ignore[misc]

    def _process_events(self, event_list: list[Any]) -> None:
        pass

    def _write_to_self(self) -> None:
        pass  # nothing runs in another thread

    def run_in_executor(self, executor: Any, func: Any, *args: Any) -> asyncio.Future[Any]:
        """Threads would break the replay: the call runs inline, at once."""
        fut = self.create_future()
        try:
            fut.set_result(func(*args))
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting task
            fut.set_exception(exc)
        return fut

    def close(self) -> None:
        self._ready.clear()
        super().close()


class _VirtualTime:
    """The ``time`` module as product code sees it during a run: the running SimLoop's
    clock for monotonic and wall time, the real module for everything else."""

    def __getattr__(self, name: str) -> Any:
        return getattr(_time, name)

    @staticmethod
    def _now() -> float | None:
        loop = asyncio._get_running_loop()
        return loop.now if isinstance(loop, SimLoop) else None

    def monotonic(self) -> float:
        now = self._now()
        return _time.monotonic() if now is None else now

    def perf_counter(self) -> float:
        return self.monotonic()

    def monotonic_ns(self) -> int:
        now = self._now()
        return _time.monotonic_ns() if now is None else int(now * 1e9)

    def perf_counter_ns(self) -> int:
        return self.monotonic_ns()

    def time(self) -> float:
        now = self._now()
        return _time.time() if now is None else _EPOCH + now

    def time_ns(self) -> int:
        return int(self.time() * 1e9)


_PREFIXES = ("lifecycle", "transport", "wire")
_SHIM = _VirtualTime()
_targets: tuple[int, list[tuple[Any, str, Any]]] = (0, [])


def _clock_targets() -> list[tuple[Any, str, Any]]:
    """(module, name, real value) for every product module name bound to a clock;
    found again only when modules were imported since the last look."""
    global _targets
    if _targets[0] == len(sys.modules):
        return _targets[1]
    found: list[tuple[Any, str, Any]] = []
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(_PREFIXES):
            continue
        if getattr(module, "time", None) is _time:
            found.append((module, "time", _time))
        for attr in _CLOCK_NAMES:
            value = getattr(module, attr, None)
            if value is not None and value is getattr(_time, attr, None):
                found.append((module, attr, value))
    _targets = (len(sys.modules), found)
    return found


_CLOCK_NAMES = ("monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns")


@contextmanager
def virtual_clock(seed: int) -> Iterator[None]:
    """Product clocks read the running SimLoop, and ``uuid.uuid4`` is seeded, until exit."""
    undo = _clock_targets()
    for module, attr, _real in undo:
        setattr(module, attr, _SHIM if attr == "time" and _real is _time else getattr(_SHIM, attr))
    real_scope = _anyio_asyncio.CancelScope
    _anyio_asyncio.CancelScope = _SimCancelScope  # type: ignore[misc]
    ids = random.Random(seed ^ 0x5EED)
    real_uuid4 = uuid.uuid4
    uuid.uuid4 = lambda: uuid.UUID(int=ids.getrandbits(128), version=4)
    try:
        yield
    finally:
        _anyio_asyncio.CancelScope = real_scope  # type: ignore[misc]
        uuid.uuid4 = real_uuid4
        for module, attr, value in undo:
            setattr(module, attr, value)
