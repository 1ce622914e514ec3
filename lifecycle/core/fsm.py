"""The request state machine: the table in ``states.py`` compiled into one dict.

``EDGE_TABLE[(state, event)] -> (dst, guard)`` is built once, at import, straight from
``states.EDGES`` and checked there (one edge per (state, event), every guard named in
``states.GUARDS`` has a callable here). It is all a request pays for. The ``transitions``
library is not used at run time: measured with ``bench/fsm.py`` (on a shared 2-core box
under load), a shared ``transitions`` machine with ``add_model``/``remove_model`` costs
311-315 us per lifecycle and leaks every model that is not removed; a RequestRecord
lifecycle costs 5.5-11.6 us (27-56x less), about 1.8x a bare dict table with no trace,
and holds no reference outside the request. ``tests/test_fsm.py`` drives a
``transitions`` machine built from ``specs/lifecycle.json`` as an independent oracle:
edge by edge, it must agree with this table.

The table decides every edge: the request path fires events with ``advance`` (False
when the table has no edge from here, or its guard refused) and handles the refusal
where it fires, never by checking the state first. ``fire`` is the strict form for edges
that must exist. Fire on lifecycle edges only; per-token progress is a counter.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from time import monotonic_ns
from types import MappingProxyType
from typing import Any, Protocol

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

log = logging.getLogger("lifecycle.core.fsm")

__all__ = [
    "EDGE_TABLE",
    "GuardRefused",
    "IllegalTransition",
    "RawEntry",
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


def _compile() -> dict[tuple[State, Event], tuple[State, str | None]]:
    table: dict[tuple[State, Event], tuple[State, str | None]] = {}
    for e in EDGES:
        where = f"{e.src.value}-{e.event.value}"
        if (e.src, e.event) in table:
            raise AssertionError(f"{where}: one edge per (state, event), got several")
        if e.guard is not None and e.guard not in GUARD_FUNCS:
            raise AssertionError(f"{where}: guard {e.guard!r} has no callable in fsm.py")
        table[(e.src, e.event)] = (e.dst, e.guard)
    if set(GUARDS) != set(GUARD_FUNCS):
        raise AssertionError(f"guards named {sorted(GUARDS)}, callables {sorted(GUARD_FUNCS)}")
    return table


# (state, event) -> (dst, guard name): the table as data, read-only (tests, the spec).
EDGE_TABLE: Mapping[tuple[State, Event], tuple[State, str | None]] = MappingProxyType(_compile())

# The hot path: (state, event) -> (dst, guard callable).
_Hot = tuple[State, Guard | None]

_HOT: dict[tuple[State, Event], _Hot] = {
    key: (dst, GUARD_FUNCS[g] if g else None) for key, (dst, g) in EDGE_TABLE.items()
}
_FAIL: dict[State, _Hot] = {src: edge for (src, ev), edge in _HOT.items() if ev is Event.FAIL}
_next_id = itertools.count(1)

# (t_ns, src, dst, event, detail): one trace entry as the record stores it.
RawEntry = tuple[int, State, State, Event, Any]


class HoldRecord(Protocol):
    """What the worker holds for a request (``lifecycle.core.submission.Submission``)."""

    @property
    def hold(self) -> WorkerHold: ...


class TransitionObserver(Protocol):
    """Told of transitions and worker releases: of one frontend's records (its feed,
    ``lifecycle.core.events``), or of every record in the process (``set_observer``)."""

    def transition(self, rec: RequestRecord, entry: RawEntry) -> None: ...

    def released(self, rec: RequestRecord) -> None: ...


# Two hooks on the hot path, each None by default (one load and one `if` per edge): the
# record's own observer (``RequestRecord.observer``: the feed of the frontend whose
# registry filed it, ``lifecycle.core.events``), and this process-wide one, which sees
# every record (tests, the simulation, a bare ``with Tracer():``). Several frontends in
# one process (one per model) each see their own records only through the first.
_observer: TransitionObserver | None = None


def set_observer(observer: TransitionObserver | None) -> TransitionObserver | None:
    """Install (or clear, with None) the process-wide observer; returns the previous one.
    A frontend's feed is not installed here: its registry gives each record it files
    that feed as its ``observer``."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def _tell(hook: Callable[..., None], *args: Any) -> None:
    """An observer's bug must never stop a transition: the state has moved already, and
    the request must still reach its end and release what it holds. Logged once per
    kind of error."""
    try:
        hook(*args)
    except Exception as exc:
        key = (getattr(hook, "__qualname__", "?"), type(exc).__name__)
        if key not in _observer_errors:
            _observer_errors.add(key)
            log.exception("the transition observer failed (%s); requests go on", key[0])


_observer_errors: set[tuple[str, str]] = set()


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
        "request_id",
        "route",
        "state",
        "cause",
        "detail",
        "_trace",
        "submission",
        "created_ns",
        "tokens",
        "released_ns",
        "observer",
    )

    def __init__(
        self,
        id: int,
        client_rid: str | None = None,
        request_id: str | None = None,
        route: str | None = None,
    ) -> None:
        self.id = id
        self.client_rid = client_rid
        # The id the client knows it by (``X-Request-Id``, the body's rid, or one the server
        # made; ``{id}_{i}`` for prompt i of a batch): not unique, unlike ``client_rid``.
        self.request_id = request_id
        self.route = route  # where it came in (a route template), None for the Engine
        self.state = INITIAL
        self.cause: Cause | None = None
        self.detail: str | None = None
        self._trace: list[RawEntry] = []
        self.submission: HoldRecord | None = None
        self.created_ns = monotonic_ns()
        # Output tokens received so far, all samples together: progress is a counter the
        # request path bumps, never an edge (the debug routes and traces report it).
        self.tokens = 0
        # When the worker let go of its hold (monotonic ns; None while it holds one, or
        # never had one): the record is the one place the hold's end is kept.
        self.released_ns: int | None = None
        # Told of this record's edges and release, beside the process-wide observer: the
        # feed of the frontend that owns it (set when its registry files it).
        self.observer: TransitionObserver | None = None

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

    @property
    def raw_trace(self) -> list[RawEntry]:
        """The trace as stored, not copied: for an observer that keeps it past the record's
        terminal state, after which it never changes (a TraceEntry per edge costs ~1.5 us)."""
        return self._trace

    def advance(self, event: Event, detail: Any = None) -> bool:
        """Take the edge ``(state, event)`` if the table has one and its guard allows it;
        False, with the state and the trace unchanged, when it does not.

        How the request path fires: an event that no longer applies (a first token
        while already streaming, a dispatch after the request failed) is the table's
        to refuse, and the caller handles the refusal where it fires."""
        src = self.state
        edge = _HOT.get((src, event))
        if edge is None:
            return False
        dst, guard = edge
        if guard is not None and not guard(self, detail):
            return False
        entry = (monotonic_ns(), src, dst, event, detail)
        self._trace.append(entry)
        self.state = dst
        if self.observer is not None:
            _tell(self.observer.transition, self, entry)
        if _observer is not None:
            _tell(_observer.transition, self, entry)
        return True

    def fire(self, event: Event, detail: Any = None) -> None:
        """``advance`` for an edge that must exist: IllegalTransition if the table has
        none from here, GuardRefused if its guard said no (the state is unchanged)."""
        if self.advance(event, detail):
            return
        where = f"request {self.id}: {event.value!r} from {self.state.value!r}"
        if (self.state, event) in _HOT:
            raise GuardRefused(f"{where}: guard refused")
        raise IllegalTransition(f"{where}: no such edge")

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
        if self.observer is not None:
            _tell(self.observer.transition, self, entry)
        if _observer is not None:
            _tell(_observer.transition, self, entry)
        return True

    def worker_released(self) -> None:
        """The hold ended (the submission said so): noted, and the observers told."""
        self.released_ns = monotonic_ns()
        if self.observer is not None:
            _tell(self.observer.released, self)
        if _observer is not None:
            _tell(_observer.released, self)


def new_request(
    client_rid: str | None = None, request_id: str | None = None, route: str | None = None
) -> RequestRecord:
    """A fresh record in RECEIVED with the next process-unique id."""
    return RequestRecord(next(_next_id), client_rid, request_id, route)


def admit(rec: RequestRecord, queue: Any) -> bool:
    """VALIDATED -> QUEUED if ``queue.try_admit()`` has room, else error(overloaded)."""
    try:
        rec.fire(Event.ADMIT, queue)
    except GuardRefused:
        rec.fail(Cause.OVERLOADED, "the server is at capacity; retry later")
        return False
    return True


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
