"""The tracer: the ring of finished traces, the trace log and the live transition feed.

A server's ``Tracer`` watches every model it serves: ``watch`` gives it one model's
requests (its id, registry, probe and recorder: ``lifecycle.tracing.probes``) as a
``TracedModel``, which that model's frontend feed subscribes (``lifecycle.core.events``):
one ring, one trace log (one writer per file) and one live feed for all of them, each
trace naming its model. Alone (tests, ``with tracer:``) it is the process-wide transition
observer (``lifecycle.core.fsm.set_observer``) of the model given to its constructor. On
each edge it does almost nothing: when a request reaches a terminal state it goes into
the ring (and, once the worker holds nothing for it, into the log); when someone watches
the feed, the edge is appended to one pending list. ``run()`` is the driver: every
``feed_interval`` it turns the pending list into one JSON message for all subscribers
(``lifecycle.tracing.feed``; a few hundred live requests make one message per tick, not
one per edge) and flushes the log.

The observer runs inside the request path (``RequestRecord.advance`` and ``fail``, the
worker link's release), so it never raises: a bug in it is logged once with its
traceback and counted (``errors``), and the request goes on. A trace log that fails
(a full disk, its directory removed) is logged once, turned off and reported
(``log_status()``: ``/metrics`` and ``/debug/requests``); serving and the ring go on.

Usage::

    tracer = Tracer(TraceConfig(log_path="traces.jsonl"), registry=registry)
    with tracer:                      # installs the observer; uninstalls and closes the log
        async with anyio.create_task_group() as tg:
            tg.start_soon(tracer.run)
            ...
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import anyio
import orjson
from anyio.streams.memory import MemoryObjectReceiveStream

from lifecycle.core import fsm
from lifecycle.core.fsm import RawEntry, RequestRecord
from lifecycle.core.registry import Registry
from lifecycle.core.states import TERMINAL, State
from lifecycle.tracing.feed import Subscriber
from lifecycle.tracing.probes import Probe, Recorder, default_probe
from lifecycle.tracing.query import key_candidates
from lifecycle.tracing.store import FinishedTrace, TraceLog, TraceRing, detail_json, live_summary

__all__ = ["TraceConfig", "TracedModel", "Tracer"]

log = logging.getLogger("lifecycle.tracing")

_DONE, _ERROR = State.DONE, State.ERROR
assert frozenset({_DONE, _ERROR}) == TERMINAL


@dataclass(frozen=True, slots=True)
class TraceConfig:
    ring_size: int = 1000  # finished traces readable from /debug/requests/{id}
    log_path: str | None = None  # one JSON line per finished request; None: no log
    log_max_bytes: int = 64 << 20  # rotate past this size
    log_backups: int = 3  # rotated files kept (path.1 .. path.N)
    feed_interval: float = 0.1  # seconds between feed messages
    feed_max_pending: int = 50_000  # edges held for the next message; past it: resync
    subscriber_queue: int = 32  # messages a slow feed client may lag; past it: resync
    record_prompts: bool = False  # --trace-prompts: prompt and output ids, for replay


class TracedModel:
    """One model's requests as the tracer reads them: the model's served id, the registry
    of its live requests, its probe and recorder. Its frontend's feed subscribes it
    (``Tracer.watch``), so it hears of that model's records only."""

    __slots__ = ("tracer", "model", "registry", "probe", "recorder")

    def __init__(
        self,
        tracer: Tracer,
        model: str | None,
        registry: Registry | None,
        probe: Probe,
        recorder: Recorder | None,
    ) -> None:
        self.tracer = tracer
        self.model = model
        self.registry = registry
        self.probe = probe
        self.recorder = recorder

    def transition(self, rec: RequestRecord, entry: RawEntry) -> None:
        self.tracer._transition(self, rec, entry)

    def released(self, rec: RequestRecord) -> None:
        self.tracer._release(self, rec)


class Tracer:
    """Observer of every transition of the models it watches; owner of the ring, the log
    and the feed subscribers. ``registry``, ``probe``, ``recorder`` and ``model``: the
    first model's (``self.own``); ``watch`` adds others."""

    def __init__(
        self,
        config: TraceConfig = TraceConfig(),
        *,
        registry: Registry | None = None,
        probe: Probe = default_probe,
        recorder: Recorder | None = None,
        model: str | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.models: list[TracedModel] = []
        self.own = self.watch(model, registry, probe, recorder)
        self.ring = TraceRing(config.ring_size)
        self.log: TraceLog | None = None
        self.log_error: str | None = None  # why the trace log was turned off
        self.unlogged = 0  # finished traces the log did not take after it failed
        self.errors = 0  # observer calls that raised (a bug); the request went on
        if config.log_path:
            try:
                self.log = TraceLog(config.log_path, config.log_max_bytes, config.log_backups)
            except OSError as exc:
                self._log_failed(exc, "open")
        # Monotonic trace times + offset = wall-clock time (measured once: one clock pair).
        self.offset_ns = time.time_ns() - time.monotonic_ns()
        self._subscribers: list[Subscriber] = []
        self._pending: list[list[Any]] = []
        self._overflow = False
        self.logged = 0

    def watch(
        self,
        model: str | None,
        registry: Registry | None,
        probe: Probe = default_probe,
        recorder: Recorder | None = None,
    ) -> TracedModel:
        """One more model's requests in this tracer's ring, log and feed: subscribe the
        answer to that model's frontend feed (``frontend.events.subscribe``). The
        recorder is asked once per finished request, and only with ``record_prompts``:
        prompts may be private, so without it no trace holds a prompt or output id."""
        recorder = recorder if self.config.record_prompts else None
        traced = TracedModel(self, model, registry, probe, recorder)
        self.models.append(traced)
        return traced

    # -- installation --------------------------------------------------------------------
    def install(self) -> None:
        self._previous = fsm.set_observer(self)

    def uninstall(self) -> None:
        """Give the observer back to the one this tracer replaced (a second Engine in a
        process that shuts down first leaves the first one's tracer working)."""
        if fsm._observer is self:
            fsm.set_observer(getattr(self, "_previous", None))

    def close(self) -> None:
        self.uninstall()
        for ft in self.ring.all():
            self._write(ft)  # still held: the worker never confirmed; log what we have
        if self.log is not None:
            try:
                self.log.close()
            except (OSError, ValueError) as exc:
                self._log_failed(exc, "close")
        for sub in self._subscribers:
            sub.send.close()

    def __enter__(self) -> Tracer:
        self.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the observer (hot path) ---------------------------------------------------------
    def transition(self, rec: RequestRecord, entry: RawEntry) -> None:
        self._transition(self.own, rec, entry)

    def released(self, rec: RequestRecord) -> None:
        self._release(self.own, rec)

    def _transition(self, m: TracedModel, rec: RequestRecord, entry: RawEntry) -> None:
        # Identity tests and ``_value_``: hashing an Enum member or reading ``.value``
        # runs Python-level code, and this runs on every edge of every request.
        try:  # free unless it raises (3.11's zero-cost try)
            dst = entry[2]
            if self._subscribers:
                self._feed(m, rec, entry[0], entry[1]._value_, dst._value_, entry[3]._value_,
                           entry[4])  # fmt: skip
            if dst is _DONE or dst is _ERROR:
                self._finish(m, rec, entry[0])
        except Exception:  # the edge is taken already: the request must go on
            self._failed(rec, "transition")

    def _release(self, m: TracedModel, rec: RequestRecord) -> None:
        try:
            self._released(m, rec)
        except Exception:  # runs in the worker link's reader: it must go on
            self._failed(rec, "release")

    def _released(self, m: TracedModel, rec: RequestRecord) -> None:
        if self._subscribers:
            state = rec.state._value_
            self._feed(m, rec, rec.released_ns or time.monotonic_ns(), state, state,
                       "worker_released", None)  # fmt: skip
        if rec.terminal:  # its trace waited for this in the ring (unless the ring dropped it)
            ft = self.ring.get(rec.id)
            if ft is not None:
                self._write(ft)

    def _failed(self, rec: RequestRecord, where: str) -> None:
        """An observer bug: logged once with its traceback, then only counted."""
        self.errors += 1
        if self.errors == 1:
            log.exception("the tracer failed on request %d (%s); the request goes on, "
                          "later failures are only counted (/metrics)", rec.id, where)  # fmt: skip
        else:
            log.debug("the tracer failed on request %d (%s)", rec.id, where, exc_info=True)

    def _feed(
        self,
        m: TracedModel,
        rec: RequestRecord,
        t_ns: int,
        src: str,
        dst: str,
        event: str,
        detail: Any,
    ) -> None:
        if len(self._pending) >= self.config.feed_max_pending:
            self._overflow = True
            return
        self._pending.append([rec.id, rec.client_rid, t_ns, src, dst, event, detail_json(detail),
                              rec.request_id, rec.route, m.model])  # fmt: skip

    def _extra(self, m: TracedModel, rec: RequestRecord) -> dict[str, Any]:
        """What the model's probe says of ``rec``, and the model's id."""
        extra = m.probe(rec)
        extra["model"] = m.model
        return extra

    def _finish(self, m: TracedModel, rec: RequestRecord, t_ns: int) -> None:
        extra = self._extra(m, rec)
        if m.recorder is not None:
            try:
                replay = m.recorder(rec)
            except Exception:  # a recorder's bug must not break the request's last edge
                log.exception("recording request %d for replay failed", rec.id)
                replay = None
            if replay is not None:
                extra["replay"] = replay
        ft = FinishedTrace(rec, t_ns, extra)
        for dropped in self.ring.add(ft):
            self._write(dropped)  # one still held goes to the log without its release
        if not rec.held_by_worker:  # else the release writes it (the record knows the hold)
            self._write(ft)

    def _write(self, ft: FinishedTrace) -> None:
        """Hand ``ft`` to the log, once."""
        if ft.logged:
            return
        ft.logged = True
        if self.log is None:
            if self.log_error is not None:
                self.unlogged += 1
            return
        trace = ft.to_json(self.offset_ns)
        try:
            self.log.write(trace)
        except (OSError, ValueError) as exc:
            self._log_failed(exc, "write")
            self.unlogged += 1
            return
        self.logged += 1

    def _flush(self) -> None:
        if self.log is not None:
            try:
                self.log.flush()
            except (OSError, ValueError) as exc:
                self._log_failed(exc, "flush")

    def _log_failed(self, exc: BaseException, doing: str) -> None:
        """The trace log failed: one clear error line, then no log (the lines its buffer
        held are lost); requests, the ring and the feed go on."""
        broken, self.log = self.log, None
        if broken is not None:
            broken.abandon()
        self.log_error = f"{doing} {self.config.log_path}: {exc}"
        log.error("trace log %s failed to %s (%s): trace logging is off until restart; "
                  "serving goes on, finished traces stay in /debug/traces while the ring "
                  "holds them", self.config.log_path, doing, exc)  # fmt: skip

    def log_status(self) -> dict[str, Any] | None:
        """The trace log's health (None without ``--trace-log``): ``ok`` false once it
        failed and was turned off, ``error`` says why; ``lines`` written, ``unlogged``
        finished traces it did not take since."""
        if self.config.log_path is None:
            return None
        return {
            "path": self.config.log_path,
            "ok": self.log_error is None,
            "error": self.log_error,
            "lines": self.logged,
            "unlogged": self.unlogged,
        }

    # -- reading -------------------------------------------------------------------------
    def lookup(self, key: str) -> dict[str, Any] | None:
        """One request's trace, live, tombstoned or finished, by internal id, client rid or
        request id, or a reply id made from one (``query.key_candidates``)."""
        for k in key_candidates(key):
            found = self._lookup(k)
            if found is not None:
                return found
        return None

    def _lookup(self, key: str) -> dict[str, Any] | None:
        for m in self.models:
            rec = _find_live(m.registry, key)
            if rec is None:
                continue
            if rec.terminal:
                ft = self.ring.get(rec.id)
                if ft is not None:
                    return ft.to_json(self.offset_ns)
            return self._live_trace(m, rec)
        ft = self.ring.get(int(key)) if key.isdigit() else None
        ft = ft or self.ring.by_rid(key)
        return ft.to_json(self.offset_ns) if ft is not None else None

    def _live_trace(self, m: TracedModel, rec: RequestRecord) -> dict[str, Any]:
        now = time.monotonic_ns()
        ft = FinishedTrace(rec, now, self._extra(m, rec))
        out = ft.to_json(self.offset_ns)
        out["finished_ns"] = None
        out["live"] = live_summary(rec, now, ft.extra)
        return out

    def live(self) -> list[dict[str, Any]]:
        """Every watched model's live requests, each naming its model."""
        now = time.monotonic_ns()
        return [
            live_summary(r, now, self._extra(m, r))
            for m in self.models
            if m.registry is not None
            for r in m.registry
        ]

    def counts(self) -> dict[str, int]:
        """Live requests per state; for done and error, how many ended there so far (the
        registries' books, every model's together)."""
        total: dict[str, int] = {}
        for m in self.models:
            if m.registry is not None:
                for state, n in m.registry.counts().items():
                    total[state] = total.get(state, 0) + n
        return total

    def finished_traces(self) -> list[dict[str, Any]]:
        return [ft.to_json(self.offset_ns) for ft in self.ring.all()]

    # -- the feed ------------------------------------------------------------------------
    def subscribe(self) -> MemoryObjectReceiveStream[bytes]:
        """A stream of feed messages (JSON bytes), starting with a snapshot of live requests.

        Close it to unsubscribe. A subscriber that falls ``subscriber_queue`` messages
        behind loses messages and gets ``"resync": true`` on the next one it receives.
        """
        send, recv = anyio.create_memory_object_stream[bytes](self.config.subscriber_queue)
        sub = Subscriber(send)
        self._subscribers.append(sub)
        sub.offer(self._message("snapshot", [], resync=False))
        return recv

    def tick(self) -> int:
        """Send every edge since the last tick as one message; returns the edges sent."""
        for gone in [s for s in self._subscribers if s.closed]:
            gone.send.close()
            self._subscribers.remove(gone)
        self._flush()
        if not self._subscribers:
            self._pending.clear()
            return 0
        batch, self._pending = self._pending, []
        overflow, self._overflow = self._overflow, False
        if batch or overflow:
            message = self._message("batch", batch, resync=overflow)
            for sub in self._subscribers:
                sub.offer(message)
        return len(batch)

    def _message(self, kind: str, batch: list[list[Any]], *, resync: bool) -> bytes:
        body: dict[str, Any] = {
            "type": kind,
            "now_ns": time.monotonic_ns(),
            "offset_ns": self.offset_ns,
            "counts": self.counts(),
            "transitions": batch,
            "resync": resync,
        }
        if kind == "snapshot":
            body["requests"] = self.live()
        return orjson.dumps(body)

    async def run(self) -> None:
        """The driver: tick every ``feed_interval`` until cancelled. It runs in the
        server's task group, so a tick that raises (a bug) is logged and counted, never
        let out to end the server."""
        while True:
            await anyio.sleep(self.config.feed_interval)
            try:
                self.tick()
            except Exception:
                self.errors += 1
                if self.errors == 1:
                    log.exception("the tracer's tick failed; the server goes on")

    @property
    def subscribers(self) -> int:
        return sum(1 for s in self._subscribers if not s.closed)


def _find_live(reg: Registry | None, key: str) -> RequestRecord | None:
    """The live or tombstoned record ``key`` names in ``reg``: its internal id, client rid
    or request id."""
    if reg is None:
        return None
    if key.isdigit():
        rec = reg.get(int(key)) or reg.tombstone(int(key))
        if rec is not None:
            return rec
    return reg.by_client_rid(key) or reg.by_request_id(key)
