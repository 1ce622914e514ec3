"""The tracer: traces through every terminal path, the bounded ring, the rotating log, the feed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import orjson
import pytest

from lifecycle.core import fsm
from lifecycle.core.fsm import RequestRecord, new_request
from lifecycle.core.registry import Registry
from lifecycle.core.states import EDGES, INITIAL, LIVE, TERMINAL, Cause, Event, State
from lifecycle.tracing.store import FinishedTrace, TraceLog, TraceRing, read_log
from lifecycle.tracing.tracer import TraceConfig, Tracer
from tests.test_fsm import PATH_TO as FSM_PATH_TO
from tests.test_fsm import drive, release

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "specs" / "trace.schema.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
ALLOWED = {(e.src.value, e.event.value, e.dst.value) for e in EDGES}

# Events that take a fresh request to each live state (no FAIL).
PATH_TO = {state: path for state, path in FSM_PATH_TO.items() if state in LIVE}
DONE_PATHS = {
    "done_from_running": [Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FINISH],
    "done_from_streaming": PATH_TO[State.STREAMING] + [Event.FINISH],
}
FAIL_PATHS = [(state, cause) for state in LIVE for cause in Cause]


@pytest.fixture
def tracer(tmp_path: Path) -> Iterator[Tracer]:
    registry = Registry()
    with Tracer(TraceConfig(log_path=str(tmp_path / "t.jsonl")), registry=registry) as t:
        yield t
    assert fsm._observer is None


def check_trace(trace: dict, events: list[Event]) -> None:
    """The trace has exactly the table's transitions for ``events``, in order, in time."""
    VALIDATOR.validate(trace)
    trs = trace["transitions"]
    assert [t["event"] for t in trs] == [e.value for e in events]
    assert trs[0]["src"] == INITIAL.value
    for prev, cur in zip(trs, trs[1:], strict=False):
        assert cur["src"] == prev["dst"]
    for t in trs:
        assert (t["src"], t["event"], t["dst"]) in ALLOWED
    times = [trace["created_ns"]] + [t["t_ns"] for t in trs]
    assert times == sorted(times)
    walls = [t["time"] for t in trs]
    assert walls == sorted(walls)
    assert trs[-1]["dst"] == trace["state"] and State(trace["state"]) in TERMINAL
    assert trace["finished_ns"] == trs[-1]["t_ns"]
    assert set(trace["states_ms"]) == {t["src"] for t in trs}


@pytest.mark.parametrize("name", sorted(DONE_PATHS))
def test_done_paths(tracer: Tracer, name: str) -> None:
    rec = new_request(f"rid-{name}")
    tracer.registry.add(rec)  # type: ignore[union-attr]
    drive(rec, DONE_PATHS[name])
    tracer.registry.remove(rec)  # type: ignore[union-attr]
    trace = tracer.lookup(str(rec.id))
    assert trace is not None and trace == tracer.lookup(f"rid-{name}")
    check_trace(trace, DONE_PATHS[name])
    assert trace["status"] == 200 and trace["cause"] is None
    handoffs = trace["handoffs"]
    assert handoffs["admitted"]["t_ns"] == trace["transitions"][1]["t_ns"]
    assert handoffs["dispatched"]["t_ns"] == trace["transitions"][2]["t_ns"]
    # The worker's terminal step entry released it just before FINISH fired.
    assert handoffs["dispatched"]["t_ns"] < handoffs["worker_released"]["t_ns"]
    assert handoffs["worker_released"]["t_ns"] <= trace["finished_ns"]
    assert (handoffs["first_token"] is None) == (name == "done_from_running")


@pytest.mark.parametrize(("state", "cause"), FAIL_PATHS, ids=lambda v: v.value)
def test_fail_paths(tracer: Tracer, state: State, cause: Cause) -> None:
    rec = new_request()
    drive(rec, PATH_TO[state])
    rec.fail(cause, f"because {cause.value}")
    if rec.held_by_worker:  # after dispatch: logged once the worker lets go
        assert tracer.logged == 0
        release(rec)
    tracer.close()
    (line,) = read_log(tracer.config.log_path)  # type: ignore[arg-type]
    check_trace(line, PATH_TO[state] + [Event.FAIL])
    assert line["cause"] == cause.value and line["status"] == cause.status
    assert line["message"] == f"because {cause.value}"
    assert line["transitions"][-1]["detail"] == cause.value
    released = line["handoffs"]["worker_released"]
    assert (released is not None) == (state in (State.RUNNING, State.STREAMING))


def test_release_before_terminal_is_kept(tracer: Tracer) -> None:
    rec = new_request()
    drive(rec, PATH_TO[State.STREAMING])
    release(rec)  # the worker's last step entry came before the error
    rec.fail(Cause.CLIENT_STALLED)
    assert tracer.logged == 1
    trace = tracer.ring.get(rec.id).to_json(tracer.offset_ns)  # type: ignore[union-attr]
    assert trace["handoffs"]["worker_released"]["t_ns"] <= trace["finished_ns"]


def test_live_lookup_and_listing(tracer: Tracer) -> None:
    rec = new_request("live-1")
    tracer.registry.add(rec)  # type: ignore[union-attr]
    rec.fire(Event.VALIDATE)
    rec.fire(Event.ADMIT)
    (row,) = tracer.live()
    assert row["id"] == rec.id and row["state"] == "queued" and row["rid"] == "live-1"
    assert row["age_ms"] >= row["in_state_ms"] >= 0
    live = tracer.lookup("live-1")
    assert live is not None and live["state"] == "queued" and live["finished_ns"] is None
    assert [t["event"] for t in live["transitions"]] == ["validate", "admit"]
    assert tracer.counts()["queued"] == 1
    assert tracer.lookup("nope") is None and tracer.lookup("999999999") is None


def test_observer_hook_is_one_slot() -> None:
    assert fsm._observer is None
    seen: list[tuple[int, str]] = []

    class Probe:
        def transition(self, rec: RequestRecord, entry: fsm.RawEntry) -> None:
            seen.append((rec.id, entry[3].value))

        def released(self, rec: RequestRecord) -> None:
            seen.append((rec.id, "released"))

    probe = Probe()
    assert fsm.set_observer(probe) is None
    try:
        rec = new_request()
        drive(rec, PATH_TO[State.RUNNING])
        rec.fail(Cause.DEADLINE)
        rec.fail(Cause.DEADLINE)  # already terminal: no edge, no call
        release(rec)
        release(rec)  # nothing held any more: no call
    finally:
        assert fsm.set_observer(None) is probe
    events = ["validate", "admit", "dispatch", "fail", "released"]
    assert seen == [(rec.id, e) for e in events]


def _finished(id: int, total_ns: int, failed: bool = False) -> FinishedTrace:
    rec = RequestRecord(id, f"r{id}")
    rec.fail(Cause.INTERNAL) if failed else None
    rec.created_ns = 0
    return FinishedTrace(rec, total_ns, {})


def test_ring_is_bounded_and_keeps_slow_and_failed() -> None:
    ring = TraceRing(20)
    slow_ids = {7, 300}
    fail_ids = {11, 500}
    for i in range(1, 2001):
        total = 10_000 + i if i in slow_ids else 100 + i % 7
        ring.add(_finished(i, total, failed=i in fail_ids))
        assert len(ring) <= 20
    held = {ft.rec.id for ft in ring.all()}
    assert slow_ids <= held and fail_ids <= held
    assert set(range(1991, 2001)) <= held  # the most recent half
    assert ring.by_rid("r7") is ring.get(7)
    assert ring.get(1500) is None and ring.by_rid("r1500") is None
    assert all(
        a.finished_ns <= b.finished_ns for a, b in zip(ring.all(), ring.all()[1:], strict=False)
    )


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_tiny_rings(size: int) -> None:
    ring = TraceRing(size)
    for i in range(1, 50):
        ring.add(_finished(i, i, failed=i % 3 == 0))
        assert 1 <= len(ring) <= size
    assert ring.get(49) is not None


def test_log_rotates(tmp_path: Path) -> None:
    path = tmp_path / "rot" / "trace.jsonl"
    log = TraceLog(path, max_bytes=2000, backups=2)
    rows = [{"n": i, "pad": "x" * 80} for i in range(100)]
    for row in rows:
        log.write(row)
    log.close()
    files = sorted(p.name for p in path.parent.iterdir())
    assert files == ["trace.jsonl", "trace.jsonl.1", "trace.jsonl.2"]
    assert log.rotations > 2
    for f in path.parent.iterdir():
        assert f.stat().st_size <= 2000
    got = [r["n"] for r in read_log(path)]
    assert got == list(range(100 - len(got), 100))  # the newest, in order, none lost between
    assert [r["n"] for r in read_log(path, rotated=False)] == got[
        -len(read_log(path, rotated=False)) :
    ]
    # Reopening appends to the current file and keeps counting its size.
    log = TraceLog(path, max_bytes=2000, backups=2)
    log.write({"n": 100})
    log.close()
    assert read_log(path)[-1]["n"] == 100


def test_tracer_log_lines_validate(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    with Tracer(TraceConfig(log_path=str(path), log_max_bytes=30_000, log_backups=5)) as t:
        for i in range(60):
            rec = new_request(f"req-{i}")
            drive(rec, DONE_PATHS["done_from_streaming"])
        t.tick()  # flushes
        assert path.stat().st_size > 0
    lines = read_log(path)
    assert [r["rid"] for r in lines] == [f"req-{i}" for i in range(60)]
    for line in lines:
        VALIDATOR.validate(line)


def test_feed_batches_transitions(tracer: Tracer) -> None:
    rec = new_request()
    rec.fire(Event.VALIDATE)  # nobody subscribed: nothing kept for the feed
    assert tracer._pending == []
    stream = tracer.subscribe()
    snapshot = orjson.loads(stream.receive_nowait())
    assert snapshot["type"] == "snapshot" and snapshot["requests"] == []
    drive(rec, (Event.ADMIT, Event.DISPATCH))
    rec.fail(Cause.ABORTED)
    release(rec)
    assert tracer.tick() == 4
    msg = orjson.loads(stream.receive_nowait())
    assert msg["type"] == "batch" and not msg["resync"]
    assert [(m[0], m[3], m[4], m[5]) for m in msg["transitions"]] == [
        (rec.id, "validated", "queued", "admit"),
        (rec.id, "queued", "running", "dispatch"),
        (rec.id, "running", "error", "fail"),
        (rec.id, "error", "error", "worker_released"),
    ]
    assert msg["transitions"][2][6] == "aborted"
    assert tracer.tick() == 0  # nothing new: no message
    stream.close()
    tracer.tick()
    assert tracer.subscribers == 0
    new_request().fire(Event.VALIDATE)
    assert tracer._pending == []


def test_slow_subscriber_gets_resync(tmp_path: Path) -> None:
    cfg = TraceConfig(subscriber_queue=2, feed_max_pending=3)
    with Tracer(cfg) as t:
        stream = t.subscribe()  # the snapshot takes one slot
        for _ in range(3):
            new_request().fire(Event.VALIDATE)
            t.tick()
        for _ in range(5):  # more than feed_max_pending edges in one tick
            new_request().fire(Event.VALIDATE)
        stream.receive_nowait(), stream.receive_nowait()
        t.tick()
        msg = orjson.loads(stream.receive_nowait())
        assert msg["resync"] and len(msg["transitions"]) == 3
        stream.close()


def test_held_traces_wait_in_the_ring_for_their_release(tmp_path: Path) -> None:
    """A trace whose record the worker still holds is logged at the release, with its time;
    one the ring drops first, or still held at close, is logged then without it. The
    record is the one keeper of the hold: the tracer keeps no copy."""
    path = tmp_path / "held.jsonl"
    with Tracer(TraceConfig(log_path=str(path), ring_size=3)) as t:  # 3 recent, no other part
        held = []
        for i in range(5):  # failed after dispatch: the worker has not answered the abort
            rec = new_request(f"held-{i}")
            drive(rec, PATH_TO[State.RUNNING])
            rec.fail(Cause.WORKER_LOST)
            held.append(rec)
        assert t.logged == 2  # the ring dropped the oldest two
        release(held[3])
        assert t.logged == 3 and held[3].released_ns is not None
        held[3].worker_released()  # a second release event logs nothing twice
        assert t.logged == 3
    assert t.logged == 5
    lines = read_log(path)
    assert [r["rid"] for r in lines] == [f"held-{i}" for i in (0, 1, 3, 2, 4)]
    released = [r["handoffs"]["worker_released"] for r in lines]
    assert [r is not None for r in released] == [False, False, True, False, False]
