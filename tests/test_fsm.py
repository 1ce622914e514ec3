"""The request state machine: table-driven edges, spec equality, registry, no leaks.

The ``transitions`` library is the oracle here: a machine built from
``specs/lifecycle.json`` must agree, edge by edge, with the table the code runs
(``lifecycle.core.fsm.EDGE_TABLE``, compiled from ``lifecycle/core/states.py``)."""

from __future__ import annotations

import dataclasses
import gc
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from transitions import Machine, MachineError

from lifecycle.core.buffers import AdmissionQueue, OutputBuffer
from lifecycle.core.errors import RequestError
from lifecycle.core.fsm import (
    EDGE_TABLE,
    GuardRefused,
    IllegalTransition,
    RequestRecord,
    admit,
    new_request,
    spec_dict,
)
from lifecycle.core.registry import DuplicateRid, Registry
from lifecycle.core.states import (
    EDGES,
    HOLD_EDGES,
    LIVE,
    TERMINAL,
    Cause,
    Event,
    HoldEdge,
    State,
    WorkerHold,
)
from lifecycle.core.submission import Submission

ROOT = Path(__file__).resolve().parent.parent
SPEC = json.loads((ROOT / "specs" / "lifecycle.json").read_text())


def _oracle(spec: dict[str, Any]) -> Machine:
    """A ``transitions`` machine for the spec's table, with no model of its own (tests
    add one per check and remove it)."""
    states = [{"name": s, "final": s in spec["terminal"]} for s in spec["states"]]
    edges = [
        {
            "trigger": e["event"],
            "source": e["src"],
            "dest": e["dst"],
            **({"conditions": e["guard"]} if e["guard"] else {}),
        }
        for e in spec["edges"]
    ]
    return Machine(
        model=None,
        states=states,
        transitions=edges,
        initial=spec["initial"],
        auto_transitions=False,  # no to_<state>() back doors around the table
    )


MACHINE = _oracle(SPEC)

# Shortest event path from RECEIVED to each state (FAIL excluded: ERROR is reached by fail()).
PATH_TO = {
    State.RECEIVED: [],
    State.VALIDATED: [Event.VALIDATE],
    State.QUEUED: [Event.VALIDATE, Event.ADMIT],
    State.RUNNING: [Event.VALIDATE, Event.ADMIT, Event.DISPATCH],
    State.STREAMING: [Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FIRST_TOKEN],
    State.DONE: [Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FINISH],
}


def drive(rec: RequestRecord, events: list[Event]) -> None:
    """Fire ``events`` as the request path does: from dispatch on the worker holds the
    request (a submission), and its terminal step entry releases it before FINISH."""
    for event in events:
        if event is Event.DISPATCH and rec.submission is None:
            holding(rec, WorkerHold.RUNNING)
        if event is Event.FINISH:
            release(rec)
        rec.fire(event)


def release(rec: RequestRecord) -> None:
    """The worker's terminal entry for a held request (no-op when nothing is held)."""
    if rec.held_by_worker:
        rec.submission.move("release")  # type: ignore[union-attr]


def record_in(state: State) -> RequestRecord:
    rec = new_request()
    if state is State.ERROR:
        rec.fail(Cause.INTERNAL)
    drive(rec, PATH_TO.get(state, []))
    assert rec.state is state
    return rec


LEGAL = [(e.src, e.event, e.dst) for e in EDGES]
ILLEGAL = [(s, ev) for s in State for ev in Event if (s, ev) not in EDGE_TABLE]


# -- the table, the machine and the spec agree ---------------------------------------------


def test_spec_file_equals_code_table() -> None:
    spec = {k: v for k, v in SPEC.items() if not k.startswith("$")}
    assert spec == spec_dict()


def test_edge_table_equals_transitions_machine() -> None:
    from_machine = {}
    for name, event in MACHINE.events.items():
        for src, candidates in event.transitions.items():
            for tr in candidates:
                guard = tr.conditions[0].func if tr.conditions else None
                from_machine[(State(src), Event(name))] = (State(tr.dest), guard)
    assert from_machine == EDGE_TABLE
    assert {s for s in MACHINE.states} == {s.value for s in State}
    assert {s for s, st_ in MACHINE.states.items() if st_.final} == {s.value for s in TERMINAL}


def test_error_reachable_from_every_live_state_and_terminals_have_no_exit() -> None:
    assert {s for (s, ev) in EDGE_TABLE if ev is Event.FAIL} == set(LIVE)
    assert not [k for k in EDGE_TABLE if k[0] in TERMINAL]


@pytest.mark.parametrize(("src", "event", "dst"), LEGAL, ids=lambda x: getattr(x, "value", x))
def test_every_edge(src: State, event: Event, dst: State) -> None:
    rec = record_in(src)
    rec.fire(event, "why")
    assert rec.state is dst
    last = rec.trace[-1]
    assert (last.src, last.dst, last.event, last.detail) == (src, dst, event, "why")
    # The transitions machine, driven with a throwaway model, agrees edge by edge.
    model = type("M", (), {"admission_has_room": lambda self: True})()
    MACHINE.add_model(model, initial=src.value)
    try:
        model.trigger(event.value)
        assert model.state == dst.value
    finally:
        MACHINE.remove_model(model)


@pytest.mark.parametrize(("src", "event"), ILLEGAL, ids=lambda x: getattr(x, "value", x))
def test_every_illegal_edge(src: State, event: Event) -> None:
    rec = record_in(src)
    before = list(rec.trace)
    with pytest.raises(IllegalTransition):
        rec.fire(event)
    assert rec.state is src and rec.trace == before
    assert rec.advance(event) is False  # the request path's form: refused, nothing moved
    assert rec.state is src and rec.trace == before
    model = type("M", (), {})()
    MACHINE.add_model(model, initial=src.value)
    try:
        with pytest.raises(MachineError):
            model.trigger(event.value)
    finally:
        MACHINE.remove_model(model)


# -- causes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cause", "status"),
    [
        (Cause.INVALID, 400),
        (Cause.TOO_LONG, 400),
        (Cause.OVERLOADED, 503),
        (Cause.NOT_READY, 503),
        (Cause.CLIENT_GONE, 499),
        (Cause.CLIENT_STALLED, 408),
        (Cause.ABORTED, 200),
        (Cause.WORKER_LOST, 503),
        (Cause.DEADLINE, 504),
        (Cause.INTERNAL, 500),
    ],
)
def test_cause_status_and_body(cause: Cause, status: int) -> None:
    assert cause.status == status
    body = cause.body("msg")
    assert body == {
        "error": {
            "message": "msg",
            "type": cause.err_type,
            "code": status,
            "retryable": cause.retryable,
        }
    }
    assert (cause.retry_after is not None) == (
        cause in {Cause.OVERLOADED, Cause.NOT_READY, Cause.WORKER_LOST}
    )


@pytest.mark.parametrize("state", list(State))
def test_fail_from_every_state(state: State) -> None:
    rec = record_in(state)
    ok = rec.fail(Cause.DEADLINE, "too slow")
    assert ok is (state in LIVE)
    if ok:
        assert (rec.state, rec.cause, rec.detail) == (State.ERROR, Cause.DEADLINE, "too slow")
        assert rec.trace[-1].detail is Cause.DEADLINE
    else:
        assert rec.state is state


# -- guards, worker hold, trace -----------------------------------------------------------


def test_admission_guard_takes_a_slot_or_refuses() -> None:
    queue = AdmissionQueue(1)
    a, b = record_in(State.VALIDATED), record_in(State.VALIDATED)
    assert admit(a, queue) and a.state is State.QUEUED and queue.depth == 1
    assert not admit(b, queue)
    assert (b.state, b.cause, b.cause.status) == (State.ERROR, Cause.OVERLOADED, 503)
    c = record_in(State.VALIDATED)
    with pytest.raises(GuardRefused):
        c.fire(Event.ADMIT, queue)
    assert c.state is State.VALIDATED and queue.depth == 1
    assert c.advance(Event.ADMIT, queue) is False  # refused without taking a slot
    assert c.state is State.VALIDATED and queue.depth == 1 and len(c.trace) == 1
    queue.release()
    c.fire(Event.ADMIT, queue)
    assert c.state is State.QUEUED and queue.depth == 1


_TO_HOLD = {
    WorkerHold.NONE: [],
    WorkerHold.QUEUED: ["submit"],
    WorkerHold.RUNNING: ["submit", "dispatch"],
    WorkerHold.RELEASED: ["submit", "dispatch", "release"],
}


def holding(rec: RequestRecord, hold: WorkerHold, released: list[int] | None = None) -> Submission:
    """Give ``rec`` a submission (the one record of what the worker holds) in ``hold``."""
    sub = Submission(rec.id, [OutputBuffer(4)], None)
    sub.on_release = rec.worker_released
    if released is not None:
        sub.on_release = lambda: released.append(rec.id)
    for event in _TO_HOLD[hold]:
        sub.move(event)
    rec.submission = sub
    return sub


def test_worker_hold_is_asked_of_the_submission() -> None:
    rec = record_in(State.QUEUED)
    assert rec.hold is WorkerHold.NONE and not rec.held_by_worker
    released: list[int] = []
    sub = holding(rec, WorkerHold.QUEUED, released)
    assert rec.hold is WorkerHold.QUEUED and not rec.held_by_worker
    rec.fire(Event.DISPATCH)
    assert not rec.held_by_worker  # the FSM edge alone says nothing of the worker
    sub.move("dispatch")
    assert rec.held_by_worker
    rec.fail(Cause.CLIENT_GONE)
    assert rec.held_by_worker  # still holds KV: needs an abort and its echo
    sub.move("release")
    assert not rec.held_by_worker and rec.hold is WorkerHold.RELEASED and released == [rec.id]
    with pytest.raises(RuntimeError):
        sub.move("dispatch")  # no edge out of released
    early = holding(record_in(State.QUEUED), WorkerHold.QUEUED, released)
    early.move("drop")  # never dispatched: dropped locally, no release to wait for
    assert early.hold is WorkerHold.RELEASED and released == [rec.id]


@pytest.mark.parametrize("edge", HOLD_EDGES, ids=lambda e: f"{e.src.value}-{e.event}")
def test_every_hold_edge_is_legal_and_nothing_else(edge: HoldEdge) -> None:
    sub = Submission(1, [OutputBuffer(1)], None)
    sub.hold = edge.src
    sub.move(edge.event)
    assert sub.hold is edge.dst
    for other in {e.event for e in HOLD_EDGES} - {e.event for e in HOLD_EDGES if e.src is edge.src}:
        sub.hold = edge.src
        with pytest.raises(RuntimeError):
            sub.move(other)


def test_trace_is_monotonic_and_complete() -> None:
    rec = record_in(State.STREAMING)
    rec.fire(Event.FINISH, {"type": "length", "length": 4})
    events = [t.event for t in rec.trace]
    assert events == [Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FIRST_TOKEN, Event.FINISH]
    times = [rec.created_ns] + [t.t_ns for t in rec.trace]
    assert times == sorted(times)
    assert all(a.dst is b.src for a, b in zip(rec.trace, rec.trace[1:], strict=False))
    with pytest.raises(dataclasses.FrozenInstanceError):
        rec.trace[0].t_ns = 0  # type: ignore[misc]


def test_ids_are_unique_and_increasing() -> None:
    ids = [new_request().id for _ in range(100)]
    assert ids == sorted(set(ids))


# -- registry -----------------------------------------------------------------------------


def test_registry_add_get_remove_and_duplicate_rid() -> None:
    reg = Registry()
    a, b = new_request("x"), new_request()
    reg.add(a)
    reg.add(b)
    assert len(reg) == 2 and reg.get(a.id) is a and reg.by_client_rid("x") is a
    with pytest.raises(DuplicateRid) as err:
        reg.add(new_request("x"))
    assert isinstance(err.value, RequestError) and err.value.status == 400
    assert err.value.message == "Duplicate request ID detected: x"
    assert set(reg) == {a, b}
    b.fire(Event.VALIDATE)
    assert reg.counts_by_state() == {
        "received": 1,
        "validated": 1,
        "queued": 0,
        "running": 0,
        "streaming": 0,
        "done": 0,
        "error": 0,
    }
    reg.remove(a)
    reg.remove(a)  # idempotent
    assert reg.get(a.id) is None and reg.by_client_rid("x") is None and len(reg) == 1
    reg.add(new_request("x"))  # the rid is free again once its request is gone


def test_registry_remove_of_a_live_request_ends_it() -> None:
    reg = Registry()
    rec = record_in(State.QUEUED)
    reg.add(rec)
    reg.remove(rec)
    assert (rec.state, rec.cause) == (State.ERROR, Cause.INTERNAL) and reg.tombstones == 0
    held = record_in(State.RUNNING)
    holding(held, WorkerHold.RUNNING)
    reg.add(held)
    reg.remove(held)
    assert held.state is State.ERROR and reg.tombstone(held.id) is held


def test_registry_keeps_tombstone_until_worker_releases() -> None:
    reg = Registry()
    rec = record_in(State.RUNNING)
    sub = holding(rec, WorkerHold.RUNNING)
    sub.on_release = lambda: reg.worker_released(rec.id)
    reg.add(rec)
    rec.fail(Cause.CLIENT_GONE)
    reg.remove(rec)
    assert len(reg) == 0 and reg.tombstones == 1 and reg.tombstone(rec.id) is rec
    sub.move("release")
    assert reg.tombstones == 0 and not rec.held_by_worker
    assert reg.worker_released(rec.id) is None  # a late duplicate echo is harmless


def test_no_leak_after_10000_lifecycles() -> None:
    reg = Registry()
    queue = AdmissionQueue(8)

    def lifecycle(i: int) -> None:
        rec = new_request(f"r{i}")
        reg.add(rec)
        rec.fire(Event.VALIDATE)
        admit(rec, queue)
        rec.fire(Event.DISPATCH)
        queue.release()
        if i % 3:
            rec.fire(Event.FIRST_TOKEN)
            rec.fire(Event.FINISH, {"type": "stop"})
        else:
            rec.fail(Cause.CLIENT_GONE)
            reg.remove(rec)
            reg.worker_released(rec.id)
        reg.remove(rec)

    for i in range(200):
        lifecycle(i)
    gc.collect()
    before = len(gc.get_objects())
    for i in range(10_000):
        lifecycle(i)
    gc.collect()
    assert len(gc.get_objects()) - before < 100
    assert len(reg) == 0 and reg.tombstones == 0 and queue.depth == 0
    assert len(MACHINE.models) == 0


# -- random event sequences ---------------------------------------------------------------


class RandomLifecycles(RuleBasedStateMachine):
    """Any sequence of events and failures leaves a request in exactly one terminal state
    at most once, never outside the table."""

    def __init__(self) -> None:
        super().__init__()
        self.rec = new_request()
        self.terminal_entries = 0

    @rule(event=st.sampled_from([e for e in Event if e is not Event.FAIL]))
    def fire(self, event: Event) -> None:
        src = self.rec.state
        if (src, event) in EDGE_TABLE:
            self.rec.fire(event)
            assert self.rec.state is EDGE_TABLE[(src, event)][0]
            self.terminal_entries += self.rec.state in TERMINAL
        else:
            with pytest.raises(IllegalTransition):
                self.rec.fire(event)
            assert self.rec.state is src

    @rule(cause=st.sampled_from(list(Cause)))
    def fail(self, cause: Cause) -> None:
        was_live = self.rec.state in LIVE
        assert self.rec.fail(cause) is was_live
        self.terminal_entries += was_live

    @invariant()
    def at_most_one_terminal(self) -> None:
        assert self.terminal_entries == (1 if self.rec.terminal else 0)
        assert [t.dst for t in self.rec.trace if t.dst in TERMINAL][1:] == []

    def teardown(self) -> None:
        # Whatever happened, ending the request from outside leaves exactly one terminal.
        self.rec.fail(Cause.CLIENT_GONE)
        assert self.rec.terminal
        assert sum(t.dst in TERMINAL for t in self.rec.trace) == 1


TestRandomLifecycles = RandomLifecycles.TestCase
TestRandomLifecycles.settings = settings(max_examples=200, stateful_step_count=20, deadline=None)


def test_diagram_doc_is_generated_from_the_spec() -> None:
    import runpy

    gen = runpy.run_path(str(ROOT / "tools" / "gen_state_diagram.py"))
    text = gen["render"](SPEC)
    assert (ROOT / "docs" / "lifecycle.md").read_text() == text
    for e in SPEC["edges"]:
        assert f"{e['src']} --> {e['dst']}: {e['event']}" in text


def test_an_observer_that_raises_never_stops_a_transition() -> None:
    """Issue 37: every observer can fail without leaving a record live. A broken
    process-wide observer is logged, and each edge still moves the record."""
    from lifecycle.core import fsm as fsm_mod

    class Broken:
        def transition(self, rec: object, entry: object) -> None:
            raise RuntimeError("observer bug")

        def released(self, rec: object) -> None:
            raise KeyError("observer bug")

    previous = fsm_mod.set_observer(Broken())
    try:
        rec = fsm_mod.new_request("obs")
        assert rec.advance(fsm_mod.Event.VALIDATE)
        assert rec.fail(fsm_mod.Cause.INTERNAL, "x")
        rec.worker_released()
        assert rec.terminal and rec.cause is fsm_mod.Cause.INTERNAL
    finally:
        fsm_mod.set_observer(previous)
