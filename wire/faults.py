"""Fault points: named places in the code that do nothing unless a fault plan is installed.

Both sides import this module (``wire`` depends on neither ``lifecycle`` nor ``gpu``).
A call site is one line::

    if (f := fault_point("worker.forward", rid)) is not None:
        f = f.apply()            # raise / kill / delay / stall happen here
        ...                      # what is left needs the call site: drop, corrupt, nan

Without a plan ``fault_point`` is one global load and one comparison (measured in
``tests/test_faults.py``: tens of nanoseconds per call, the cost of any Python call).

A plan is a list of rules: which point, when (the Nth hit, a probability with a seed,
a request id, how many times) and what. Plans come from tests (``installed(plan)``, a
context manager) or, for chaos runs against a live server, from the environment
variable ``LIFECYCLE_FAULTS`` (JSON text, or the path of a JSON file) read at import.
``lifecycle serve --faults FILE`` sets that variable, so the worker process it spawns
loads the same plan: points are named per side (``frontend.*``, ``worker.*``), so each
process fires only its own. JSON shape::

    {"rules": [{"point": "worker.forward", "action": "kill", "nth": 5}]}

Points: ``frontend.dispatch``, ``frontend.frame_send``, ``frontend.frame_recv``,
``frontend.client_write``, ``frontend.tokenize``, ``worker.start``, ``worker.forward``,
``worker.sample``, ``worker.frame_send``, ``worker.frame_recv``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ACTIONS",
    "ENV_VAR",
    "POINTS",
    "Fault",
    "FaultPlan",
    "FaultRule",
    "InjectedFault",
    "active_plan",
    "fault_point",
    "install",
    "installed",
    "load_plan",
]

ENV_VAR = "LIFECYCLE_FAULTS"

POINTS = frozenset(
    {
        "frontend.dispatch",
        "frontend.frame_send",
        "frontend.frame_recv",
        "frontend.client_write",
        "frontend.tokenize",
        "worker.start",
        "worker.forward",
        "worker.sample",
        "worker.frame_send",
        "worker.frame_recv",
    }
)
# raise/kill/delay/stall are applied by ``Fault.apply``; the others need the call site.
ACTIONS = frozenset({"raise", "delay", "stall", "drop", "corrupt", "kill", "nan"})
CONTEXT_ACTIONS = frozenset({"drop", "corrupt", "nan"})


class InjectedFault(RuntimeError):
    """What a ``raise`` rule raises: an unexpected error at that point."""


@dataclass(frozen=True, slots=True)
class FaultRule:
    point: str
    action: str
    nth: int = 1  # first hit (1-based, counted per process) that may fire
    times: int = 1  # how many times it fires; 0: every time from ``nth`` on
    probability: float = 1.0  # each eligible hit fires with this chance (seeded)
    seed: int = 0
    rid: int | None = None  # only hits for this request id
    delay: float = 0.0  # seconds, for ``delay``
    message: str = "injected fault"

    def __post_init__(self) -> None:
        if self.point not in POINTS:
            raise ValueError(f"unknown fault point {self.point!r}; known: {sorted(POINTS)}")
        if self.action not in ACTIONS:
            raise ValueError(f"unknown fault action {self.action!r}; known: {sorted(ACTIONS)}")
        if self.nth < 1 or self.times < 0 or not 0.0 <= self.probability <= 1.0:
            raise ValueError(f"bad fault rule timing: {self}")


@dataclass(frozen=True, slots=True)
class Fault:
    """One firing: applied in place (``apply``) or handed to the call site."""

    point: str
    action: str
    rid: int | None
    delay: float
    message: str

    def apply(self) -> Fault | None:
        """Apply what needs no context (blocking: use ``apply_async`` on an event loop).

        Returns ``self`` when the call site must act (drop, corrupt, nan)."""
        if self.action == "delay":
            time.sleep(self.delay)
        elif self.action == "stall":
            threading.Event().wait()
        return self._common()

    async def apply_async(self) -> Fault | None:
        import anyio

        if self.action == "delay":
            await anyio.sleep(self.delay)
        elif self.action == "stall":
            await anyio.sleep_forever()
        return self._common()

    def _common(self) -> Fault | None:
        if self.action == "raise":
            raise InjectedFault(f"{self.message} at {self.point}")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return self if self.action in CONTEXT_ACTIONS else None


@dataclass(slots=True)
class _RuleState:
    rule: FaultRule
    rng: random.Random
    hits: int = 0
    fired: int = 0


@dataclass(slots=True)
class FaultPlan:
    rules: list[FaultRule]
    log: list[Fault] = field(default_factory=list)  # every firing, in order
    _states: dict[str, list[_RuleState]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the worker has threads

    def __post_init__(self) -> None:
        for r in self.rules:
            self._states.setdefault(r.point, []).append(_RuleState(r, random.Random(r.seed)))

    @classmethod
    def from_json(cls, data: Any) -> FaultPlan:
        rules = data.get("rules", []) if isinstance(data, dict) else data
        if not isinstance(rules, list):
            raise ValueError("a fault plan is a list of rules or {'rules': [...]}")
        return cls([FaultRule(**r) for r in rules])

    def to_json(self) -> str:
        fields = FaultRule.__dataclass_fields__
        return json.dumps({"rules": [{k: getattr(r, k) for k in fields} for r in self.rules]})

    def has(self, point: str) -> bool:
        """Whether a rule names ``point``."""
        return point in self._states

    def hit(self, point: str, rid: int | None) -> Fault | None:
        states = self._states.get(point)
        if not states:
            return None
        with self._lock:
            for st in states:
                r = st.rule
                if r.rid is not None and r.rid != rid:
                    continue
                st.hits += 1
                if st.hits < r.nth or (r.times and st.fired >= r.times):
                    continue
                if r.probability < 1.0 and st.rng.random() >= r.probability:
                    continue
                st.fired += 1
                fault = Fault(point, r.action, rid, r.delay, r.message)
                self.log.append(fault)
                return fault
        return None

    def fired(self, point: str | None = None) -> int:
        return sum(1 for f in self.log if point is None or f.point == point)


_plan: FaultPlan | None = None


def fault_point(name: str, rid: int | None = None) -> Fault | None:
    """The hook. Without a plan: one global check, then ``None``."""
    if _plan is None:
        return None
    return _plan.hit(name, rid)


def active_plan() -> FaultPlan | None:
    return _plan


def install(plan: FaultPlan | None) -> FaultPlan | None:
    """Install ``plan`` for this process (None: remove); returns the previous one."""
    global _plan
    previous, _plan = _plan, plan
    return previous


@contextmanager
def installed(plan: FaultPlan | list[FaultRule]) -> Iterator[FaultPlan]:
    """Install a plan for the duration of a ``with`` block (this process only)."""
    p = plan if isinstance(plan, FaultPlan) else FaultPlan(list(plan))
    previous = install(p)
    try:
        yield p
    finally:
        install(previous)


def load_plan(text: str) -> FaultPlan:
    """A plan from JSON text, or from the path of a JSON file."""
    stripped = text.strip()
    if not stripped.startswith(("{", "[")):
        with open(stripped, encoding="utf-8") as f:
            stripped = f.read()
    return FaultPlan.from_json(json.loads(stripped))


if os.environ.get(ENV_VAR):
    install(load_plan(os.environ[ENV_VAR]))
