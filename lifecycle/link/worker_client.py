"""The dispatcher: one connection to one worker (``specs/wire.cddl``).

- Credits: the worker's HELLO announces ``capacity.max_pending``, the number of rids the
  frontend may have submitted and not yet seen terminate. Requests beyond that wait
  here, in submission order, in a queue bounded by ``max_queued`` (a submission past it
  is refused as overloaded); everything that fits goes out in ONE Submit frame.
- What the worker holds for each submission (``WorkerHold``: queued here, running there,
  released) is recorded in its ``Submission`` (``lifecycle.core.submission``), which
  only this client moves, and nowhere else.
- The abort lane: aborts are sent before any submit and are never held back by credits.
- Egress: every STEP entry is appended to its rid's sink (an ``OutputBuffer``) without
  awaiting, one frame per scheduler step.
- Tombstones: a request whose owner left is aborted and its rids kept (output dropped)
  until the worker's terminal entry confirms it released everything; only then is the
  credit returned and the submission released. Nothing is freed on the frontend's word
  alone.

Knows nothing of HTTP; usable by any in-process caller.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio

import wire
from lifecycle.core.buffers import ADMISSION_BOUND, CONTROL_HEADROOM
from lifecycle.core.states import Cause, WorkerHold
from lifecycle.core.submission import Sink, Submission, WorkerFailure, finish_reason
from lifecycle.link.wire_stream import FrameStream
from wire.faults import fault_point

__all__ = [
    "DEFAULT_MAX_QUEUED",
    "LOST_ON_THE_WAY",
    "SUBMIT_ENTRY_LIMIT",
    "WorkerClient",
    "WorkerRefused",
]

log = logging.getLogger("lifecycle.worker")


# The most one SUBMIT frame's entries may take (the frame's own header is a few bytes).
SUBMIT_ENTRY_LIMIT = wire.MAX_FRAME_BYTES - 1024
LOST_ON_THE_WAY = "worker lost: the request never reached the worker"


class WorkerRefused(ConnectionError):
    """The worker would not serve this frontend (no token, or a wrong one)."""


DEFAULT_MAX_QUEUED = ADMISSION_BOUND + CONTROL_HEADROOM  # admitted requests and probes


class WorkerClient:
    def __init__(
        self, frames: FrameStream, hello: wire.Hello, max_queued: int = DEFAULT_MAX_QUEUED
    ) -> None:
        self._frames = frames
        self.model: dict[str, Any] = hello.model
        self.capacity: dict[str, Any] = hello.capacity
        self.max_pending = max(1, int(hello.capacity.get("max_pending", 1)))
        self.pid = int(hello.model.get("pid", 0))
        self._rids = itertools.count(1)
        self._nonces = itertools.count(1)
        self.max_queued = max_queued
        self._queue: deque[Submission] = deque()  # never longer than max_queued
        self._held: dict[int, tuple[Submission, int]] = {}  # wire rid -> (submission, sample)
        self._in_flight = 0
        self._abort_lane: list[int] = []
        self._sent_upto = 0  # every rid up to this one went out in a SUBMIT frame
        self._replies: dict[int, list[Any]] = {}  # nonce -> [Event, reply]
        self._wake = anyio.Event()
        self.closed = False
        self.last_progress_ns = time.monotonic_ns()

    @classmethod
    async def handshake(
        cls, frames: FrameStream, max_queued: int = DEFAULT_MAX_QUEUED, token: str | None = None
    ) -> WorkerClient:
        """HELLO, after answering the worker's CHALLENGE with ``token`` when it asks
        (``wire.auth``); ``WorkerRefused`` says why a worker would not serve us."""
        frame = await frames.receive()
        if isinstance(frame, wire.Challenge):
            if token is None:
                raise WorkerRefused(
                    f"the worker asks for a token: set --worker-token or ${wire.TOKEN_ENV}"
                )
            await frames.send(wire.Auth(wire.auth_mac(token, frame.nonce)))
            frame = await frames.receive()
            if isinstance(frame, wire.Fatal):
                raise WorkerRefused(f"the worker refused the link: {frame.message}")
        elif token is not None and isinstance(frame, wire.Hello):
            log.warning("the worker does not check tokens: it serves anyone who reaches it")
        if not isinstance(frame, wire.Hello):
            raise wire.WireError(f"expected HELLO first, got {type(frame).__name__}")
        return cls(frames, frame, max_queued)

    # -- what the request handlers call (never blocks) ------------------------------------
    def submit(
        self,
        prompt: list[int],
        sampling: dict[str, Any],
        options: dict[str, Any],
        sinks: list[Sink],
        on_dispatch: Callable[[], None] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> Submission:
        """Queue one request with ``len(sinks)`` samples. A refusal (closed connection,
        ``n`` over the worker's capacity, the queue full) finishes its sinks at once."""
        n = len(sinks)
        base = next(self._rids)
        for _ in range(n - 1):
            next(self._rids)
        if n > 1:
            sampling = {**sampling, "n": n}
        entry = wire.SubmitEntry(base, wire.pack_ids(prompt), sampling, options)
        sub = Submission(base, sinks, entry, on_dispatch, on_release)
        refusal = None
        if self.closed:
            refusal = WorkerFailure(Cause.WORKER_LOST, "the worker is not connected")
        elif n > self.max_pending:
            msg = f"n={n} exceeds the worker's capacity of {self.max_pending} sequences"
            refusal = WorkerFailure(Cause.INVALID, msg)
        elif len(self._queue) >= self.max_queued:
            refusal = WorkerFailure(Cause.OVERLOADED, "the dispatch queue is full; retry later")
        elif (size := wire.submit_entry_bytes(entry)) > SUBMIT_ENTRY_LIMIT:
            msg = (
                f"the request's prompt and parameters take {size} bytes on the worker link, "
                f"more than the {SUBMIT_ENTRY_LIMIT} one request may"
            )
            refusal = WorkerFailure(Cause.INVALID, msg)
        else:
            sub.entry_bytes = size
        if refusal is not None:
            sub.end_all(refusal)
            sub.move("refuse")
            return sub
        sub.move("submit")
        self._queue.append(sub)
        self._wake.set()
        return sub

    def abort(self, sub: Submission, *, forget: bool = False, message: str = "aborted") -> None:
        """End ``sub``: at once if it is still queued here, else through the abort lane
        (the worker's terminal entries release it). ``forget``: its owner is gone, drop
        its output from now on."""
        if sub.hold is WorkerHold.QUEUED:
            self._queue.remove(sub)
            sub.end_all({"type": wire.Finish.ABORT, "message": message})
            sub.move("drop")
            return
        if sub.hold is not WorkerHold.RUNNING:
            return
        if sub.abort_message is None:
            sub.abort_message = message
        live = [sub.rid + i for i, s in enumerate(sub.sinks) if s is not None or forget]
        live = [r for r in live if r in self._held]
        if forget:
            sub.sinks = [None] * sub.n
        if live:
            self._abort_lane.extend(live)
            self._wake.set()

    def abort_sample(self, sub: Submission, index: int, message: str) -> None:
        """Stop one sample the frontend gave up on (its output was malformed)."""
        sub.sinks[index] = None
        rid = sub.rid + index
        if rid in self._held:
            self._abort_lane.append(rid)
            self._wake.set()

    def abort_all(self) -> None:
        for sub in list(self._queue):
            self.abort(sub)
        for sub in {id(s): s for s, _ in self._held.values()}.values():
            self.abort(sub)

    @property
    def in_flight(self) -> int:
        """Rids the worker holds (tombstones included)."""
        return self._in_flight

    @property
    def tombstones(self) -> int:
        """Rids the worker holds whose output nobody reads any more."""
        return sum(1 for sub, i in self._held.values() if sub.sinks[i] is None)

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return bool(self._in_flight)

    # -- control round trips -------------------------------------------------------------
    async def _call(self, frame_cls: Callable[[int], Any], timeout: float) -> Any:
        nonce = next(self._nonces)
        slot: list[Any] = [anyio.Event(), None]
        self._replies[nonce] = slot
        try:
            with anyio.fail_after(timeout):
                await self._frames.send(frame_cls(nonce))
                await slot[0].wait()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            # The worker was just lost (or closed as hung): a caller sees one error type.
            raise ConnectionError("the worker connection closed") from exc
        finally:
            self._replies.pop(nonce, None)
        if slot[1] is None:
            raise ConnectionError("the worker connection closed")
        return slot[1]

    async def probe(self, timeout: float = 5.0) -> dict[str, Any]:
        reply: wire.ProbeReply = await self._call(wire.Probe, timeout)
        return reply.load

    async def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        reply: wire.Stats = await self._call(wire.StatsReq, timeout)
        return reply.load

    async def audit(self, timeout: float = 5.0) -> int:
        """End every request the frontend sent that the worker does not hold (lost on
        the way: ``wire.cddl`` AUDIT) with worker_lost; returns how many. The others,
        and the worker, go on."""
        upto = self._sent_upto
        asked = [rid for rid in self._held if rid <= upto]
        if not asked:
            return 0
        reply: wire.AuditReply = await self._call(lambda n: wire.Audit(n, asked), timeout)
        lost = [rid for rid in reply.missing if rid in self._held]
        for rid in lost:
            log.error("rid %d never reached the worker; ending it", rid)
            self._end(rid, WorkerFailure(Cause.WORKER_LOST, LOST_ON_THE_WAY))
        return len(lost)

    async def flush(self, timeout: float = 30.0) -> tuple[bool, str]:
        reply: wire.FlushReply = await self._call(wire.Flush, timeout)
        return reply.ok, reply.message

    async def close(self) -> None:
        """Drop the connection: ``run`` returns and everything held fails worker_lost."""
        await self._frames.aclose()

    async def shutdown(self) -> None:
        with anyio.move_on_after(2), anyio.CancelScope(shield=True):
            try:
                await self._frames.send(wire.Shutdown())
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass

    # -- the connection's two loops --------------------------------------------------------
    async def run(self) -> str:
        """Serve the connection until it ends; returns why. Every request still held is
        then finished with ``WorkerFailure(Cause.WORKER_LOST)``."""
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
                    await self._frames.send(wire.Abort(rids))
                for batch in self._take_ready():  # each under the frame size limit
                    upto = max(e.rid + e.sampling.get("n", 1) - 1 for e in batch)
                    batch = await _dispatch_faults(batch)
                    if batch:
                        await self._frames.send(wire.Submit(batch))
                    # a SUBMIT now precedes any AUDIT that asks for these rids
                    self._sent_upto = max(self._sent_upto, upto)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            await self._frames.aclose()  # the reader sees EOF and ends the connection

    def _take_ready(self) -> list[list[wire.SubmitEntry]]:
        """What the credits allow, in submission order, cut into SUBMIT frames that each
        stay under the frame size limit."""
        batches: list[list[wire.SubmitEntry]] = []
        batch: list[wire.SubmitEntry] = []
        size = 0
        while self._queue:
            sub = self._queue[0]
            if self._in_flight + sub.n > self.max_pending:
                break
            self._queue.popleft()
            if not self._in_flight:  # idle until now: the hung-worker clock starts here
                self.last_progress_ns = time.monotonic_ns()
            for i in range(sub.n):
                self._held[sub.rid + i] = (sub, i)
            self._in_flight += sub.n
            assert sub.entry is not None
            if batch and size + sub.entry_bytes > SUBMIT_ENTRY_LIMIT:
                batches.append(batch)
                batch, size = [], 0
            batch.append(sub.entry)
            size += sub.entry_bytes
            sub.entry = None  # the prompt is the worker's now
            sub.move("dispatch")
        if batch:
            batches.append(batch)
        return batches

    async def _reader(self) -> str:
        while True:
            try:
                frame = await self._frames.receive()
            except anyio.EndOfStream:
                return "the worker closed the connection"
            except (wire.WireError, ValueError) as exc:
                return f"corrupt frame from the worker: {exc}"
            match frame:
                case wire.Step():
                    # Only work counts as progress for the hung-worker watchdog: a worker
                    # that answers STATS and PROBE but never steps a held request (one
                    # lost on the way, say) is still hung.
                    self.last_progress_ns = time.monotonic_ns()
                    self._on_step(frame)
                case wire.ReqError(errors):
                    self.last_progress_ns = time.monotonic_ns()
                    for rid, code, message in errors:
                        self._end(rid, WorkerFailure.of_req_error(code, message))
                case (
                    wire.ProbeReply(nonce)
                    | wire.Stats(nonce)
                    | wire.FlushReply(nonce)
                    | wire.AuditReply(nonce)
                ):
                    slot = self._replies.get(nonce)
                    if slot is not None:
                        slot[1] = frame
                        slot[0].set()
                case wire.Fatal(message):
                    return f"the worker reported a protocol error: {message}"
                case _:
                    return f"unexpected frame from the worker: {type(frame).__name__}"

    def _on_step(self, frame: wire.Step) -> None:
        held = self._held
        for e in frame.entries:
            found = held.get(e.rid)
            if found is None:
                log.warning("output for unknown rid %d ignored", e.rid)
                continue
            sub, i = found
            sink = sub.sinks[i]
            if sink is not None and (e.new_ids or e.extra):
                try:
                    sink.append(wire.ids_to_list(e.new_ids), e.extra)
                except Exception as exc:  # e.g. OutputOverflow: a worker bug, end this rid
                    log.error("rid %d: bad output from the worker: %s", e.rid, exc)
                    self.abort_sample(sub, i, "invalid output")
                    sink.finish(WorkerFailure(Cause.INTERNAL, "the worker sent invalid output"))
            if e.finish is not None:
                reason = finish_reason(e.finish)
                if reason["type"] == wire.Finish.ABORT and sub.abort_message is not None:
                    reason["message"] = sub.abort_message  # ours, not the worker's words
                self._end(e.rid, reason)

    def _end(self, rid: int, reason: Any) -> None:
        found = self._held.pop(rid, None)
        if found is None:
            return
        sub, i = found
        self._in_flight -= 1
        sink, sub.sinks[i] = sub.sinks[i], None
        if sink is not None:
            sink.finish(reason)
        sub.open -= 1
        if sub.open == 0:  # the worker holds nothing more for this submission
            sub.move("release")
        if self._queue:
            self._wake.set()

    def _fail_all(self, reason: str) -> None:
        self.closed = True
        lost = WorkerFailure(Cause.WORKER_LOST, f"worker lost: {reason}")
        held = list({id(s): s for s, _ in self._held.values()}.values())
        queued = list(self._queue)
        self._held.clear()
        self._queue.clear()
        self._in_flight = 0
        for sub in held:
            sub.end_all(lost)
            sub.open = 0
            sub.move("release")
        for sub in queued:
            sub.end_all(lost)
            sub.move("drop")
        for slot in self._replies.values():
            slot[0].set()


async def _dispatch_faults(batch: list[wire.SubmitEntry]) -> list[wire.SubmitEntry]:
    """Fault point ``frontend.dispatch``: "drop" loses an entry on the way to the worker
    (what a dispatcher bug would do; the hung-worker watchdog must still end it)."""
    kept = []
    for entry in batch:
        f = fault_point("frontend.dispatch", entry.rid)
        if f is None or await f.apply_async() is None:
            kept.append(entry)
    return kept
