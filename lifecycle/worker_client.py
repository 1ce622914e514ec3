"""The dispatcher: one connection to one worker (``specs/wire.cddl``).

- Credits: the worker's HELLO announces ``capacity.max_pending``, the number of rids the
  frontend may have submitted and not yet seen terminate. Requests beyond that wait
  here, in submission order; everything that fits goes out in ONE Submit frame.
- The abort lane: aborts are sent before any submit and are never held back by credits.
- Egress: every STEP entry is appended to its rid's sink (an ``OutputBuffer``) without
  awaiting, one frame per scheduler step.
- Tombstones: a request whose owner left is aborted and its rid kept (sink ``None``)
  until the worker's terminal entry confirms it released everything; only then is the
  credit returned. Nothing is freed on the frontend's word alone.

Knows nothing of HTTP; usable by any in-process caller.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from lifecycle.wire_stream import FrameStream
from wire import (
    Abort,
    Fatal,
    Flush,
    FlushReply,
    Hello,
    Probe,
    ProbeReply,
    ReqError,
    Shutdown,
    Stats,
    StatsReq,
    Step,
    Submit,
    SubmitEntry,
    WireError,
    ids_to_list,
    pack_ids,
)

__all__ = ["Sink", "WorkerClient", "WorkerFailure", "finish_reason"]

log = logging.getLogger("lifecycle.worker")


class Sink(Protocol):
    """Where one sample's output goes (``lifecycle.buffers.OutputBuffer`` fits)."""

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> object: ...

    def finish(self, reason: Any) -> object: ...


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """Terminal reason when the worker refused a request or the connection was lost.

    ``code``: "invalid" | "too_long" | "internal" (REQ-ERROR codes) or "worker_lost"."""

    code: str
    message: str


def finish_reason(finish: list[Any]) -> dict[str, Any]:
    """A wire ``finish`` -> SGLang's ``meta_info.finish_reason`` object."""
    kind, value = finish
    if kind == "stop":
        return {"type": "stop", "matched": value}
    if kind == "length":
        return {"type": "length", "length": value}
    return {"type": "abort", "message": str(value)}


@dataclass(slots=True)
class _Queued:
    entry: SubmitEntry
    sinks: list[Sink]
    on_dispatch: Any  # Callable[[], None] | None


class WorkerClient:
    def __init__(self, frames: FrameStream, hello: Hello) -> None:
        self._frames = frames
        self.model: dict[str, Any] = hello.model
        self.capacity: dict[str, Any] = hello.capacity
        self.max_pending = max(1, int(hello.capacity.get("max_pending", 1)))
        self.pid = int(hello.model.get("pid", 0))
        self._rids = itertools.count(1)
        self._nonces = itertools.count(1)
        self._queue: deque[_Queued] = deque()
        self._sinks: dict[int, Sink | None] = {}  # rid -> sink; None = tombstone
        self._in_flight = 0
        self._abort_lane: list[int] = []
        self._replies: dict[int, list[Any]] = {}  # nonce -> [Event, reply]
        self._wake = anyio.Event()
        self.closed = False
        self.last_progress_ns = time.monotonic_ns()

    @classmethod
    async def handshake(cls, frames: FrameStream) -> WorkerClient:
        frame = await frames.receive()
        if not isinstance(frame, Hello):
            raise WireError(f"expected HELLO first, got {type(frame).__name__}")
        return cls(frames, frame)

    # -- what the request handlers call (never blocks) ------------------------------------
    def submit(
        self,
        prompt: list[int],
        sampling: dict[str, Any],
        options: dict[str, Any],
        sinks: list[Sink],
        on_dispatch: Any = None,
    ) -> list[int]:
        """Queue one request with ``len(sinks)`` samples; returns its wire rids."""
        n = len(sinks)
        base = next(self._rids)
        for _ in range(n - 1):
            next(self._rids)
        rids = list(range(base, base + n))
        if self.closed:
            for s in sinks:
                s.finish(WorkerFailure("worker_lost", "the worker is not connected"))
            return rids
        if n > self.max_pending:
            msg = f"n={n} exceeds the worker's capacity of {self.max_pending} sequences"
            for s in sinks:
                s.finish(WorkerFailure("invalid", msg))
            return rids
        if n > 1:
            sampling = {**sampling, "n": n}
        entry = SubmitEntry(base, pack_ids(prompt), sampling, options)
        self._queue.append(_Queued(entry, sinks, on_dispatch))
        self._wake.set()
        return rids

    def abort(self, rids: list[int], *, forget: bool = False, message: str = "aborted") -> None:
        """End these rids. ``forget``: the owner is gone, drop output from now on."""
        wanted = set(rids)
        for q in list(self._queue):
            if q.entry.rid in wanted:  # never reached the worker: ends here
                self._queue.remove(q)
                for s in q.sinks:
                    s.finish({"type": "abort", "message": message})
        held = [r for r in rids if r in self._sinks]
        if forget:
            for r in held:
                self._sinks[r] = None
        if held:
            self._abort_lane.extend(held)
            self._wake.set()

    def abort_all(self) -> None:
        self.abort([q.entry.rid for q in self._queue] + list(self._sinks))

    @property
    def in_flight(self) -> int:
        """Rids the worker holds (tombstones included)."""
        return self._in_flight

    @property
    def tombstones(self) -> int:
        return sum(1 for s in self._sinks.values() if s is None)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    # -- control round trips -------------------------------------------------------------
    async def _call(self, frame_cls: Any, timeout: float) -> Any:
        nonce = next(self._nonces)
        slot: list[Any] = [anyio.Event(), None]
        self._replies[nonce] = slot
        try:
            with anyio.fail_after(timeout):
                await self._frames.send(frame_cls(nonce))
                await slot[0].wait()
        finally:
            self._replies.pop(nonce, None)
        if slot[1] is None:
            raise ConnectionError("the worker connection closed")
        return slot[1]

    async def probe(self, timeout: float = 5.0) -> dict[str, Any]:
        reply: ProbeReply = await self._call(Probe, timeout)
        return reply.load

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        reply: Stats = await self._call(StatsReq, timeout)
        return reply.load

    async def flush(self, timeout: float = 30.0) -> tuple[bool, str]:
        reply: FlushReply = await self._call(Flush, timeout)
        return reply.ok, reply.message

    async def close(self) -> None:
        """Drop the connection: ``run`` returns and everything held fails worker_lost."""
        await self._frames.aclose()

    async def shutdown(self) -> None:
        with anyio.move_on_after(2), anyio.CancelScope(shield=True):
            try:
                await self._frames.send(Shutdown())
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    # -- the connection's two loops --------------------------------------------------------
    async def run(self) -> str:
        """Serve the connection until it ends; returns why. Every request still held is
        then finished with ``WorkerFailure("worker_lost")``."""
        reason = "connection closed"
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._writer)
                reason = await self._reader()
                tg.cancel_scope.cancel()
        finally:
            self._fail_all(reason)
            await self._frames.aclose()
        return reason

    async def _writer(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                if self._abort_lane:
                    rids, self._abort_lane = self._abort_lane, []
                    await self._frames.send(Abort(rids))
                batch = self._take_ready()
                if batch:
                    await self._frames.send(Submit(batch))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._frames.aclose()  # the reader sees EOF and ends the connection

    def _take_ready(self) -> list[SubmitEntry]:
        batch: list[SubmitEntry] = []
        while self._queue:
            q = self._queue[0]
            n = len(q.sinks)
            if self._in_flight + n > self.max_pending:
                break
            self._queue.popleft()
            if not self._in_flight:  # idle until now: the hung-worker clock starts here
                self.last_progress_ns = time.monotonic_ns()
            for i, s in enumerate(q.sinks):
                self._sinks[q.entry.rid + i] = s
            self._in_flight += n
            batch.append(q.entry)
            if q.on_dispatch is not None:
                q.on_dispatch()
        return batch

    async def _reader(self) -> str:
        while True:
            try:
                frame = await self._frames.receive()
            except anyio.EndOfStream:
                return "the worker closed the connection"
            except (WireError, ValueError) as exc:
                return f"corrupt frame from the worker: {exc}"
            self.last_progress_ns = time.monotonic_ns()
            match frame:
                case Step():
                    self._on_step(frame)
                case ReqError(errors):
                    for rid, code, message in errors:
                        self._end(rid, WorkerFailure(code, message))
                case ProbeReply(nonce) | Stats(nonce) | FlushReply(nonce):
                    slot = self._replies.get(nonce)
                    if slot is not None:
                        slot[1] = frame
                        slot[0].set()
                case Fatal(message):
                    return f"the worker reported a protocol error: {message}"
                case _:
                    return f"unexpected frame from the worker: {type(frame).__name__}"

    def _on_step(self, frame: Step) -> None:
        sinks = self._sinks
        for e in frame.entries:
            if e.rid not in sinks:
                log.warning("output for unknown rid %d ignored", e.rid)
                continue
            sink = sinks[e.rid]
            if sink is not None and (e.new_ids or e.extra):
                try:
                    sink.append(ids_to_list(e.new_ids), e.extra)
                except Exception as exc:  # e.g. OutputOverflow: a worker bug, end this rid
                    log.error("rid %d: bad output from the worker: %s", e.rid, exc)
                    sinks[e.rid] = None
                    sink.finish(WorkerFailure("internal", "the worker sent invalid output"))
                    self.abort([e.rid])
            if e.finish is not None:
                self._end(e.rid, finish_reason(e.finish))

    def _end(self, rid: int, reason: Any) -> None:
        if rid not in self._sinks:
            return
        sink = self._sinks.pop(rid)
        self._in_flight -= 1
        if sink is not None:
            sink.finish(reason)
        if self._queue:
            self._wake.set()

    def _fail_all(self, reason: str) -> None:
        self.closed = True
        lost = WorkerFailure("worker_lost", f"worker lost: {reason}")
        sinks = [s for s in self._sinks.values() if s is not None]
        sinks += [s for q in self._queue for s in q.sinks]
        self._sinks.clear()
        self._queue.clear()
        self._in_flight = 0
        for s in sinks:
            s.finish(lost)
        for slot in self._replies.values():
            slot[0].set()
