"""The request state machine: one ``transitions`` definition per process, a dict on the hot path.

The machine is built once, at import, from the table in ``states.py`` and checked
against it; its transitions are then compiled into ``COMPILED[(state, event)] -> (dst,
guard)``, which is all a request pays for. Measured with ``bench/fsm.py`` (all rows in one
run, on a shared 2-core box under load): a shared ``transitions`` machine with
``add_model``/``remove_model`` costs 311-315 us per lifecycle and leaks every model that is
not removed; a RequestRecord lifecycle costs 5.5-11.6 us (27-56x less), about 1.8x a bare
dict table with no trace, and holds no reference outside the request. The machine stays the definition the
tests, the spec check and the diagram are held against.

Fire the machine on lifecycle edges only; per-token progress is a counter elsewhere.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import monotonic_ns
from typing import Any, Protocol

from transitions import Machine

from lifecycle.core.errors import RequestError
from lifecycle.core.states import (
    CAUSE_TABLE,
    DRAIN,
    EDGES,
    GUARDS,
    HOLD_EDGES,
    INITIAL,
    TERMINAL,
    Cause,
    Event,
    State,
    WorkerHold,
)

__all__ = [
    "COMPILED",
    "MACHINE",
    "DuplicateRid",
    "GuardRefused",
    "IllegalTransition",
    "Registry",
    "RequestRecord",
    "TraceEntry",
    "TransitionObserver",
    "admit",
    "new_request",
    "set_observer",
    "spec_dict",
]


class IllegalTransition(RuntimeError):
    """An event fired in a state that has no edge for it (a bug in the caller)."""


class GuardRefused(IllegalTransition):
    """The edge exists but its guard said no; the state is unchanged."""


class DuplicateRid(RequestError):
    """The client's ``rid`` names a request that is still live (SGLang's message)."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"Duplicate request ID detected: {rid}", 400)
        self.rid = rid


@dataclass(frozen=True, slots=True)
class TraceEntry:
    t_ns: int
    src: State
    dst: State
    event: Event
    detail: Any


def _admission_has_room(rec: RequestRecord, detail: Any) -> bool:
    # With the AdmissionQueue as detail the guard takes the slot itself; without one the
    # caller has already taken it with try_admit() (and fails the request OVERLOADED
    # when that refused), so there is nothing left to check.
    try_admit = getattr(detail, "try_admit", None)
    return True if try_admit is None else bool(try_admit())


Guard = Callable[["RequestRecord", Any], bool]
GUARD_FUNCS: dict[str, Guard] = {"admission_has_room": _admission_has_room}


def _build_machine() -> Machine:
    states = [{"name": s.value, "final": s in TERMINAL} for s in State]
    transitions = [
        {
            "trigger": e.event.value,
            "source": e.src.value,
            "dest": e.dst.value,
            **({"conditions": e.guard} if e.guard else {}),
        }
        for e in EDGES
    ]
    # model=None: requests are never added as models (see the module docstring);
    # auto_transitions=False: no to_<state>() back doors around the table.
    return Machine(
        model=None,
        states=states,
        transitions=transitions,
        initial=INITIAL.value,
        auto_transitions=False,
    )


def _compile(machine: Machine) -> dict[tuple[State, Event], tuple[State, str | None]]:
    table: dict[tuple[State, Event], tuple[State, str | None]] = {}
    for name, event in machine.events.items():
        for src, candidates in event.transitions.items():
            if len(candidates) != 1:
                raise AssertionError(f"{src}-{name}: one edge per (state, event), got many")
            (tr,) = candidates
            guards = [str(c.func) for c in tr.conditions]
            if len(guards) > 1 or any(g not in GUARD_FUNCS for g in guards):
                raise AssertionError(f"{src}-{name}: unknown or multiple guards {guards}")
            table[(State(src), Event(name))] = (State(tr.dest), guards[0] if guards else None)
    return table


MACHINE: Machine = _build_machine()
COMPILED = _compile(MACHINE)
if COMPILED != {(e.src, e.event): (e.dst, e.guard) for e in EDGES} or set(GUARDS) != set(
    GUARD_FUNCS
):  # pragma: no cover - the table and the machine were built from each other
    raise AssertionError("compiled state table disagrees with lifecycle.core.states.EDGES")

# The hot path: (state, event) -> (dst, guard).
_Hot = tuple[State, Guard | None]

_HOT: dict[tuple[State, Event], _Hot] = {
    key: (dst, GUARD_FUNCS[g] if g else None) for key, (dst, g) in COMPILED.items()
}
_FAIL: dict[State, _Hot] = {src: edge for (src, ev), edge in _HOT.items() if ev is Event.FAIL}
_next_id = itertools.count(1)

# (t_ns, src, dst, event, detail): one trace entry as the record stores it.
RawEntry = tuple[int, State, State, Event, Any]


class HoldRecord(Protocol):
    """What the worker holds for a request (``lifecycle.core.worker_client.Submission``)."""

    @property
    def hold(self) -> WorkerHold: ...


class TransitionObserver(Protocol):
    """Told of every transition and worker release in this process (``lifecycle.tracing.tracer``)."""

    def transition(self, rec: RequestRecord, entry: RawEntry) -> None: ...

    def released(self, rec: RequestRecord) -> None: ...


# The one hook on the hot path: None (the default) costs one global load and one `if`
# per edge. Module-level rather than per record so a record carries no extra slot.
_observer: TransitionObserver | None = None


def set_observer(observer: TransitionObserver | None) -> TransitionObserver | None:
    """Install (or clear, with None) the process-wide observer; returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


class RequestRecord:
    """One request's lifecycle: its state, error cause, trace, and where to ask what the
    worker holds for it (its ``submission``; the record keeps no copy of that fact).

    The trace is kept as plain tuples and turned into TraceEntry objects when read:
    it is written on every edge and read only when someone looks (a frozen dataclass
    per edge would be most of the machine's cost).
    """

    __slots__ = (
        "id",
        "client_rid",
        "state",
        "cause",
        "detail",
        "_trace",
        "submission",
        "created_ns",
        "tokens",
    )

    def __init__(self, id: int, client_rid: str | None = None) -> None:
        self.id = id
        self.client_rid = client_rid
        self.state = INITIAL
        self.cause: Cause | None = None
        self.detail: str | None = None
        self._trace: list[tuple[int, State, State, Event, Any]] = []
        self.submission: HoldRecord | None = None
        self.created_ns = monotonic_ns()
        # Output tokens received so far, all samples together: progress is a counter the
        # request path bumps, never an edge (the debug routes and traces report it).
        self.tokens = 0

    def __repr__(self) -> str:
        cause = f" cause={self.cause.value}" if self.cause else ""
        held = " held" if self.held_by_worker else ""
        return f"<RequestRecord {self.id} {self.state.value}{cause}{held}>"

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL

    @property
    def hold(self) -> WorkerHold:
        sub = self.submission
        return WorkerHold.NONE if sub is None else sub.hold

    @property
    def held_by_worker(self) -> bool:
        """Whether the worker may still hold KV blocks for this request (asks the hold)."""
        sub = self.submission
        return sub is not None and sub.hold is WorkerHold.RUNNING

    @property
    def trace(self) -> list[TraceEntry]:
        """Every transition so far, oldest first (a fresh list on each read)."""
        return [TraceEntry(*entry) for entry in self._trace]

    def fire(self, event: Event, detail: Any = None) -> None:
        """Take the edge ``(state, event)``; raise IllegalTransition if there is none."""
        src = self.state
        edge = _HOT.get((src, event))
        if edge is None:
            raise IllegalTransition(f"request {self.id}: no {event.value!r} from {src.value!r}")
        dst, guard = edge
        if guard is not None and not guard(self, detail):
            raise GuardRefused(
                f"request {self.id}: guard refused {event.value!r} from {src.value!r}"
            )
        entry = (monotonic_ns(), src, dst, event, detail)
        self._trace.append(entry)
        self.state = dst
        if _observer is not None:
            _observer.transition(self, entry)

    def fail(self, cause: Cause, detail: str | None = None) -> bool:
        """Move to ERROR with ``cause`` from any live state; False if already terminal.

        What the worker holds is unchanged: a held request still needs its abort echo.
        """
        src = self.state
        edge = _FAIL.get(src)
        if edge is None:
            return False
        self.cause = cause
        self.detail = detail
        entry = (monotonic_ns(), src, edge[0], Event.FAIL, cause)
        self._trace.append(entry)
        self.state = edge[0]
        if _observer is not None:
            _observer.transition(self, entry)
        return True

    def worker_released(self) -> None:
        """Tell the observer that the hold ended (the submission said so)."""
        if _observer is not None:
            _observer.released(self)


def new_request(client_rid: str | None = None) -> RequestRecord:
    """A fresh record in RECEIVED with the next process-unique id."""
    return RequestRecord(next(_next_id), client_rid)


def admit(rec: RequestRecord, queue: Any) -> bool:
    """VALIDATED -> QUEUED if ``queue.try_admit()`` has room, else error(overloaded)."""
    try:
        rec.fire(Event.ADMIT, queue)
    except GuardRefused:
        rec.fail(Cause.OVERLOADED, "the server is at capacity; retry later")
        return False
    return True


class Registry:
    """The live requests of this process, plus tombstones the worker still holds.

    ``remove`` on a record the worker still holds (an error after dispatch) keeps it as a
    tombstone until ``worker_released(id)``: its KV blocks are not free until then. Whether
    it is held is asked of the record's submission, never copied here.
    """

    __slots__ = ("_live", "_by_rid", "_tombstones")

    def __init__(self) -> None:
        self._live: dict[int, RequestRecord] = {}
        self._by_rid: dict[str, RequestRecord] = {}
        self._tombstones: dict[int, RequestRecord] = {}

    def add(self, rec: RequestRecord) -> None:
        rid = rec.client_rid
        if rid is not None:
            if rid in self._by_rid:
                raise DuplicateRid(rid)
            self._by_rid[rid] = rec
        self._live[rec.id] = rec

    def remove(self, rec: RequestRecord) -> None:
        """Forget a request; one that is not terminal yet is failed INTERNAL first, so
        every request that leaves the registry has reached exactly one terminal state."""
        if self._live.pop(rec.id, None) is None:
            return
        if rec.state not in TERMINAL:
            rec.fail(Cause.INTERNAL, "removed from the registry while still live")
        if rec.client_rid is not None:
            self._by_rid.pop(rec.client_rid, None)
        if rec.held_by_worker:
            self._tombstones[rec.id] = rec

    def worker_released(self, id: int) -> RequestRecord | None:
        """The hold of request ``id`` ended (its submission is released): a tombstone is
        forgotten now."""
        rec = self._tombstones.pop(id, None) or self._live.get(id)
        if rec is not None:
            rec.worker_released()
        return rec

    def get(self, id: int) -> RequestRecord | None:
        return self._live.get(id)

    def tombstone(self, id: int) -> RequestRecord | None:
        return self._tombstones.get(id)

    @property
    def tombstones(self) -> int:
        return len(self._tombstones)

    def by_client_rid(self, rid: str) -> RequestRecord | None:
        return self._by_rid.get(rid)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._live.values()))

    def __contains__(self, rec: object) -> bool:
        return isinstance(rec, RequestRecord) and self._live.get(rec.id) is rec

    def counts_by_state(self) -> dict[str, int]:
        counts = dict.fromkeys((s.value for s in State), 0)
        for rec in self._live.values():
            counts[rec.state.value] += 1
        return counts


def spec_dict() -> dict[str, Any]:
    """The code's state table in the shape of ``specs/lifecycle.json``."""
    return {
        "version": 1,
        "states": [s.value for s in State],
        "initial": INITIAL.value,
        "terminal": sorted(s.value for s in TERMINAL),
        "events": [e.value for e in Event],
        "guards": dict(GUARDS),
        "edges": [
            {"src": e.src.value, "event": e.event.value, "dst": e.dst.value, "guard": e.guard}
            for e in EDGES
        ],
        "worker_hold": {
            "states": [h.value for h in WorkerHold],
            "initial": WorkerHold.NONE.value,
            "edges": [
                {"src": e.src.value, "event": e.event, "dst": e.dst.value} for e in HOLD_EDGES
            ],
        },
        "causes": {
            c.value: {
                "status": i.status,
                "err_type": i.err_type,
                "retry_after": i.retry_after,
                "retryable": i.retryable,
            }
            for c, i in CAUSE_TABLE.items()
        },
        "drain": {
            "signals": list(DRAIN.signals),
            "health_status": DRAIN.health_status,
            "refused": DRAIN.refused.value,
            "timeout_s": DRAIN.timeout_s,
            "cut": DRAIN.cut.value,
            "exit_code": DRAIN.exit_code,
        },
    }
