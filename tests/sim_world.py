"""What the simulation reads from the server between groups: the books (registry,
tombstones, worker credits, the worker's own load) and the terminal transitions of every
record, seen through the state machine's observer hook (``lifecycle.core.fsm.set_observer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio

from lifecycle.app import App
from lifecycle.core.fsm import RawEntry, RequestRecord, TransitionObserver
from lifecycle.core.states import TERMINAL

__all__ = ["Books", "TerminalCounter", "books", "settle"]


@dataclass(frozen=True, slots=True)
class Books:
    live: int  # records in the registry
    tombstones: int
    in_flight: int  # worker credits the frontend's client holds
    running: int  # the worker's own books (STATS)
    waiting: int
    kv_used: int

    @property
    def worker(self) -> tuple[int, int, int, int]:
        return self.in_flight, self.running, self.waiting, self.kv_used

    def within(self, baseline: Books) -> bool:
        """Nothing held beyond what was already leaked before (the baseline)."""
        mine = (self.live, self.tombstones, *self.worker)
        theirs = (baseline.live, baseline.tombstones, *baseline.worker)
        return all(a <= b for a, b in zip(mine, theirs, strict=True))


_LOST = (ConnectionError, TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError)


async def books(app: App) -> Books:
    """The books now; waits for a restarting worker (bounded by the caller's scope)."""
    while True:
        client = await app.supervisor.wait_ready()
        try:
            load: dict[str, Any] = await client.stats(timeout=1.0)
        except _LOST:  # a worker killed by the last scenario: wait for the next one
            await anyio.sleep(0.01)
            continue
        registry = app.frontend.registry
        return Books(
            live=len(registry),
            tombstones=registry.tombstones,
            in_flight=client.in_flight,
            running=int(load["running"]),
            waiting=int(load["waiting"]),
            kv_used=int(load["kv_blocks_total"]) - int(load["kv_blocks_free"]),
        )


async def settle(app: App, baseline: Books, timeout: float) -> Books:
    """Poll until the books are back within ``baseline`` or ``timeout`` passed."""
    last: Books | None = None
    with anyio.move_on_after(timeout):
        while True:
            last = await books(app)
            if last.within(baseline):
                return last
            await anyio.sleep(0.005)
    if last is None:  # the worker never came back: read what the frontend has
        with anyio.fail_after(30):
            last = await books(app)
    return last


@dataclass
class TerminalCounter:
    """A transition observer counting terminal transitions per record, chained to the
    observer that was installed before (tracing, when debug routes are on)."""

    previous: TransitionObserver | None = None
    _group: dict[int, tuple[RequestRecord, int]] = field(default_factory=dict)

    def begin(self) -> None:
        """Start a new group: only records that move from now on are counted."""
        self._group = {}

    def transition(self, rec: RequestRecord, entry: RawEntry) -> None:
        _, count = self._group.get(rec.id, (rec, 0))
        self._group[rec.id] = (rec, count + (entry[2] in TERMINAL))
        if self.previous is not None:
            self.previous.transition(rec, entry)

    def released(self, rec: RequestRecord) -> None:
        if self.previous is not None:
            self.previous.released(rec)

    def group_records(self) -> list[RequestRecord]:
        return [rec for rec, _ in self._group.values()]

    def group_counts(self) -> list[tuple[RequestRecord, int]]:
        return list(self._group.values())
