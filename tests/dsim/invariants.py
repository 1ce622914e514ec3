"""What must hold after every scenario; each returns (name, what broke) pairs.

- ``quiet``: nothing live in the registry or the live calls, no tombstone, nothing
  queued or in flight at the worker client, nothing running, waiting or holding KV
  blocks in the worker.
- ``answered``: every request the server admitted (it has a record, or its response
  began) got a whole answer: a complete HTTP response whose stream ends with ``[DONE]``
  after a finish reason or an error event, or a WebSocket ``done``/``error``; unless its
  client left first. A connection cut under a request is a violation.
- ``honest``: an answer reports what the record says: a request that ended in error
  (aborted included) is never reported as a normal completion.
- ``tokens``: a finished request's record counted exactly the tokens the worker
  generated for it, and the client was told that many (``completion_tokens``/usage);
  a native request's ``output_ids`` are the scripted output.
- ``aborts``: a request an ``/abort_request`` found live never finishes normally, unless
  the worker had already finished it before the abort was taken.
- ``rids``: every client rid is free again once its request ended: the registry names
  none of them, and (half the seeds) a batch reusing them all is served.
- ``no_hang``: every client is done within the scenario's virtual budget.
- ``worker_kept``: the worker is never restarted unless the scenario killed it, stalled
  it or broke its link: a restart fails every request it held, so restarting a healthy
  worker (a leaked credit looking like a hang, say) is a violation.
- ``no_internal``: no answer is a 500 and no record ends ``internal`` (our bug, by the
  cause table's definition), except where a ``frontend.client_write`` fault made the
  handler fail on purpose.
- ``released``: the worker generates nothing for a request more than ``RELEASE_BOUND``
  virtual seconds after its client left (closed or reset its connection before the end;
  a half-close is not leaving): the departure aborts the request (issue 54, point 2).
"""

from __future__ import annotations

from typing import Any

from lifecycle.core.states import Cause, State
from tests.dsim.clients import Answer
from tests.dsim.scenario import Played, Req, Scenario
from tests.dsim.world import RecordLog, World
from wire.faults import FaultPlan

__all__ = ["NAMES", "check"]

NAMES = (
    "quiet", "answered", "honest", "tokens", "aborts", "rids", "no_hang", "worker_kept",
    "no_internal", "released",
)  # fmt: skip
# Virtual seconds the worker may go on generating for a request whose client left: the
# frontend sees the departure at its next write (a stream) or its connection watch (a
# unary request), aborts, and the worker drops the request at its next step (a few
# 2 ms steps). A request that ran on unaborted runs up to 480 tokens, about 1 s.
RELEASE_BOUND = 0.1
# Faults that take the worker or its link down: a restart after them is the cure.
LINK_BREAKERS = frozenset({
    "forward_stall", "fe_send_drop", "fe_recv_corrupt", "worker_send_drop", "worker_recv_corrupt",
})  # fmt: skip
Violation = tuple[str, str]


def check(scn: Scenario, world: World, played: Played, plan: FaultPlan) -> list[Violation]:
    out: list[Violation] = []
    books = {k: v for k, v in world.live_books().items() if v}
    if books:
        out.append(("quiet", f"still held after the scenario: {books}"))
    out += [("no_hang", f"{label} not answered within the budget") for label in played.hung]
    restarts = world.supervisor.restarts
    broken = played.killed or world.link_fired or (scn.fault in LINK_BREAKERS and plan.log)
    if restarts and not broken:
        out.append(("worker_kept", f"the worker was restarted {restarts}x with nothing wrong with "
                                   f"it: {world.supervisor.last_error}"))  # fmt: skip
    by_label = _records_by_label(world)
    client_write_cut = plan.fired("frontend.client_write") > 0
    for q in scn.reqs:
        a = played.answers.get(q.label)
        if a is None:
            continue
        recs = by_label.get(q.label, [])
        out += _answered(q, a, recs, client_write_cut)
        out += _honest(q, a, recs)
        out += _tokens(q, a, recs)
        out += _released(q, a, recs, world)
    if not client_write_cut:
        out += _internal(scn, world, played)
    out += _tokens_books(world)
    out += _aborts(world)
    registry = world.frontend.registry
    taken = [log.label for log in world.scenario_records.values() if log.rec.client_rid
             and registry.by_client_rid(log.rec.client_rid) is not None]  # fmt: skip
    if taken:
        out.append(("rids", f"rids still taken after their requests ended: {taken}"))
    elif played.reuse is not None and not (played.reuse.status == 200 and played.reuse.complete):
        out.append(("rids", f"reusing the rids: {played.reuse.status} {played.reuse.body[:200]!r}"))
    return out


def _records_by_label(world: World) -> dict[str, list[RecordLog]]:
    out: dict[str, list[RecordLog]] = {}
    for log in world.scenario_records.values():
        if not log.label.startswith("#"):
            out.setdefault(log.label.split("_")[0], []).append(log)
    return out


def _answered(q: Req, a: Answer, recs: list[RecordLog], cut_by_fault: bool) -> list[Violation]:
    if a.left or cut_by_fault:
        return []
    admitted = bool(recs) or (a.status is not None and a.status != 101) or bool(a.events)
    if not a.complete:
        if admitted:
            return [("answered", f"{q.label} ({q.face}) admitted, then cut: {a.cut}")]
        return []
    ev = a.events
    if a.status == 200 and q.stream and q.face == "responses":
        last = ev[-1].get("type") if ev and isinstance(ev[-1], dict) else None
        if last not in _RESPONSE_ENDS:
            return [("answered", f"{q.label} response stream ended with {last!r}")]
    elif a.status == 200 and q.stream:
        if not ev or ev[-1] != "[DONE]":
            return [("answered", f"{q.label} stream did not end with [DONE]")]
        if not any(_is_error(e) for e in ev) and not _stream_finished(q, ev):
            return [("answered", f"{q.label} stream ended without a finish reason or an error")]
    return []


# The terminal events of a /v1/responses stream (OpenAI's Responses streaming events).
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


def _is_error(event: Any) -> bool:
    return isinstance(event, dict) and ("error" in event or event.get("type") == "error")


def _stream_finished(q: Req, events: list[Any]) -> bool:
    for e in events:
        if not isinstance(e, dict):
            continue
        if q.face == "native" and (e.get("meta_info") or {}).get("finish_reason"):
            return True
        if any(c.get("finish_reason") for c in e.get("choices", ()) if isinstance(c, dict)):
            return True
    return False


def _client_end(q: Req, a: Answer) -> str | None:
    """How the client was told its request ended: "ok", "abort", "error" (None: unknown)."""
    if not a.complete or a.status is None:
        return None
    if a.status == 101:  # WebSocket
        last = a.events[-1] if a.events else {}
        if last.get("type") == "error":
            return "error"
        finish = (last.get("meta_info") or {}).get("finish_reason") or {}
        return "abort" if finish.get("type") == "abort" else "ok"
    if a.status != 200:
        return "error"
    if q.face == "responses":
        return _response_end(q, a)
    if q.stream and any(_is_error(e) for e in a.events):
        return "error"
    return "abort" if b'"abort"' in a.body else "ok"


def _response_end(q: Req, a: Answer) -> str:
    """A /v1/responses answer: completed, or incomplete for max_output_tokens, is a
    normal end; incomplete for another reason or cancelled is an abort; else an error."""
    final: dict[str, Any] = _json(a.body)
    if q.stream:
        ends = [e for e in a.events if isinstance(e, dict) and e.get("type") in _RESPONSE_ENDS]
        final = (ends[-1].get("response") or {}) if ends else {}
    status = final.get("status")
    reason = (final.get("incomplete_details") or {}).get("reason")
    if status == "completed" or (status == "incomplete" and reason == "max_output_tokens"):
        return "ok"
    return "abort" if status in ("incomplete", "cancelled") else "error"


def _honest(q: Req, a: Answer, recs: list[RecordLog]) -> list[Violation]:
    seen = _client_end(q, a)
    if seen != "ok" or not recs:
        return []
    failed = [r for r in recs if r.rec.state is State.ERROR]
    if failed:
        cause = failed[0].rec.cause
        return [("honest", f"{q.label} ({q.face}) reported as completed; its record ended "
                           f"error({cause.value if cause else '?'})")]  # fmt: skip
    if q.face == "responses" and a.complete and any(r.rec.cause is Cause.ABORTED for r in recs):
        return [("honest", f"{q.label} aborted, reported as completed")]
    return []


def _tokens(q: Req, a: Answer, recs: list[RecordLog]) -> list[Violation]:
    if _client_end(q, a) != "ok" or not recs or q.face in ("embeddings", "score"):
        return []
    if any(r.rec.state is not State.DONE for r in recs):
        return []
    told = _completion_tokens(q, a)
    counted = sum(r.rec.tokens for r in recs)
    out = []
    if told is not None and told != counted:
        out.append(
            (
                "tokens",
                f"{q.label} ({q.face}): client told {told} tokens, the record counted {counted}",
            )
        )
    if q.face == "native" and not q.oversized and a.status == 200 and not q.stream:
        ids = _json(a.body).get("output_ids")
        want = [q.prompt[i % len(q.prompt)] for i in range(counted)]
        if ids is not None and ids != want:
            out.append(("tokens", f"{q.label}: output_ids {ids} are not the scripted {want}"))
    return out


def _released(q: Req, a: Answer, recs: list[RecordLog], world: World) -> list[Violation]:
    """Issue 54, point 2: nothing generates for a client that left, beyond a bound."""
    if a.left_at is None:
        return []
    out = []
    for log in recs:
        if log.life is None:
            continue
        until = max((world.generated_until.get((log.life, rid), 0.0) for rid in log.wire_rids),
                    default=0.0)  # fmt: skip
        if until > a.left_at + RELEASE_BOUND:
            out.append(("released", f"{q.label}: the worker generated for it "
                                    f"{until - a.left_at:.3f} s after its client left"))  # fmt: skip
    return out


def _completion_tokens(q: Req, a: Answer) -> int | None:
    if a.status == 101:
        return (a.events[-1].get("meta_info") or {}).get("completion_tokens")
    if q.stream:
        events = [e for e in a.events if isinstance(e, dict)]
        if q.face == "native":
            last = [e for e in events if e.get("meta_info")]
            return last[-1]["meta_info"].get("completion_tokens") if last else None
        if q.face == "responses":
            done = [
                e for e in events if e.get("type") in ("response.completed", "response.incomplete")
            ]
            return (
                ((done[-1].get("response") or {}).get("usage") or {}).get("output_tokens")
                if done
                else None
            )
        usage = [e["usage"] for e in events if e.get("usage")]
        return usage[-1].get("completion_tokens") if usage else None
    body = _json(a.body)
    if q.face == "native":
        return (body.get("meta_info") or {}).get("completion_tokens")
    usage = body.get("usage") or {}
    return usage.get("output_tokens" if q.face == "responses" else "completion_tokens")


def _json(body: bytes) -> dict[str, Any]:
    import orjson

    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _internal(scn: Scenario, world: World, played: Played) -> list[Violation]:
    out = []
    for q in scn.reqs:
        a = played.answers.get(q.label)
        if a is not None and (a.status == 500 or any(
            isinstance(e, dict) and (e.get("error") or {}).get("code") in (500, "internal")
            for e in a.events
        )):  # fmt: skip
            out.append(
                ("no_internal", f"{q.label} ({q.face}) answered {a.status} {a.body[:160]!r}")
            )
    for log in world.scenario_records.values():
        if log.rec.cause is Cause.INTERNAL:
            out.append(("no_internal", f"record {log.label} ended internal: {log.rec.detail}"))
    return out


def _tokens_books(world: World) -> list[Violation]:
    out = []
    for log in world.scenario_records.values():
        rec = log.rec
        if rec.state is not State.DONE or log.life is None:
            continue
        made = sum(world.generated.get((log.life, rid), 0) for rid in log.wire_rids)
        if made != rec.tokens:
            out.append(("tokens", f"record {log.label}: the worker generated "
                                  f"{made} tokens, the record counted {rec.tokens}"))  # fmt: skip
    return out


def _aborts(world: World) -> list[Violation]:
    out = []
    for seen in world.aborts:
        for rec, life, rids in seen.live:
            if rec.state is not State.DONE:
                continue
            before = (
                life is not None
                and rids
                and all(world.finished_at.get((life, rid), 1 << 62) < seen.seq for rid in rids)
            )
            if not before:
                how = f"rid {seen.rid}" if seen.rid else "abort_all"
                when = "before its submission" if life is None else "while the worker held it"
                out.append(("aborts", f"{rec.client_rid or '-'} finished normally after "
                                      f"/abort_request ({how}) found it live {when}"))  # fmt: skip
    return out
