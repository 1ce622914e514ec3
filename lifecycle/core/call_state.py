"""One generate call's state, sans I/O: its records, samples and buffers, and the books
that move them (``lifecycle.core.call`` is the driver that awaits around it).

A ``CallState`` holds one ``ItemRun`` per prompt (a batch has several): its
``RequestRecord``, ``n`` samples, each with its own ``OutputBuffer`` and the ``_Sink``
the worker link feeds it through. Everything here is synchronous: opening the records,
admitting them, building a prompt's samples and submitting it, polling the buffers,
ending a record, aborting and closing. It never awaits, sleeps or reads a clock; what it
tells the worker goes through the ``WorkerLink`` port (``submit``, ``abort``), whose
calls queue a frame and return. ``close`` is the one exit: every record terminal, what
the worker holds aborted, the admission slot returned, the host told.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from lifecycle.core.buffers import AdmissionQueue, OutputBuffer
from lifecycle.core.detok import TextCodec, TokenizerLike
from lifecycle.core.errors import ServeError
from lifecycle.core.fsm import RequestRecord, admit, new_request
from lifecycle.core.origin import ORIGIN, Origin, new_request_id
from lifecycle.core.outputs import OutputOptions, SampleOutput, grammar_detail, prompt_reasoning
from lifecycle.core.params import GenerateItem, GenerateRequest, check_lengths
from lifecycle.core.ports import WorkerLink
from lifecycle.core.reasoning import ReasoningFormat, budget_option
from lifecycle.core.registry import DuplicateRid
from lifecycle.core.states import Cause, Event, State
from lifecycle.core.submission import Sink, Submission, WorkerFailure
from lifecycle.core.wakeup import Wakeup
from wire import Finish

__all__ = ["CallHost", "CallState", "ItemRun"]

log = logging.getLogger("lifecycle.core.call")


class CallHost(Protocol):
    """What a call asks of the process around it (``lifecycle.core.frontend.Frontend``)."""

    @property
    def admission(self) -> AdmissionQueue: ...

    @property
    def codec(self) -> TextCodec: ...

    @property
    def tokenizer(self) -> TokenizerLike: ...

    @property
    def model_config(self) -> Any: ...

    @property
    def output_margin(self) -> int: ...

    @property
    def weight_version(self) -> str: ...

    @property
    def reasoning(self) -> ReasoningFormat | None: ...

    def dp_rank(self, client: WorkerLink) -> int | None: ...

    def ready_client(self, prompt: Sequence[int] | None = None) -> WorkerLink: ...

    def must_load(self) -> bool: ...

    async def load_model(self) -> None: ...

    def opened(self, rec: RequestRecord, call: Any) -> None: ...

    def worker_released(self, rec_id: int) -> None: ...

    def closed(self, call: Any) -> None: ...


class _Sink:
    """One sample's wire sink: its buffer plus the call's wake-up and token counter."""

    __slots__ = ("buffer", "rec", "call")

    def __init__(self, buffer: OutputBuffer, rec: RequestRecord, call: CallState) -> None:
        self.buffer, self.rec, self.call = buffer, rec, call

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> None:
        self.buffer.append(ids, extra)
        self.rec.tokens += len(ids)
        self.call.wake()

    def finish(self, reason: Any) -> None:
        self.buffer.finish(reason)
        self.call.wake()


class ItemRun:
    """One prompt of the call: its record, samples, buffers and submission."""

    __slots__ = ("rec", "item", "samples", "buffers", "sub", "admitted", "ended")

    # ``item`` None: a request refused before it was parsed (``reject``), never submitted.
    def __init__(self, rec: RequestRecord, item: GenerateItem | None) -> None:
        self.rec = rec
        self.item = item
        self.samples: list[SampleOutput] = []
        self.buffers: list[OutputBuffer] = []
        self.sub: Submission | None = None  # what the worker holds: asked, never copied
        self.admitted = False
        # How its samples end when an abort or a cut came before the submission did
        # (while the prompt was being tokenized): it is then never submitted.
        self.ended: Any = None


class CallState:
    """The call's records and samples and every synchronous move on them."""

    def __init__(self, host: CallHost, req: GenerateRequest) -> None:
        self.host = host
        self.req = req
        self.runs: list[ItemRun] = []
        self.client: WorkerLink | None = None
        self._wake = Wakeup()
        self.closed = False
        # The HTTP exchange it is made for (None for the Engine): its request id names the
        # call's records (``X-Request-Id``; the body's rid when the client sent no header).
        self.origin: Origin | None = ORIGIN.get()
        self.http_status: int | None = None  # a rejection's status, when not its cause's
        self.request_id = self._name_exchange(req)
        # What the owner may run at a wake-up instead of waking (``set_push``), and what
        # a push polled but left to the owner (``hand_back``).
        self._push: Callable[[], bool] | None = None
        self._defer: Callable[[Callable[[], None]], None] | None = None  # runs the push
        self._push_queued = False
        self._handed_back: list[tuple[int, SampleOutput]] = []

    def _name_exchange(self, req: GenerateRequest) -> str:
        ex = self.origin
        first = req.items[0].client_rid if len(req.items) == 1 else None
        if ex is None or ex.per_call:
            return first or new_request_id()
        ex.calls += 1
        if first:
            ex.adopt(first)
        return ex.id

    def _item_request_id(self, index: int) -> str:
        """Prompt ``index``'s request id: the call's, or ``{id}_{index}`` in a batch."""
        return self.request_id if len(self.req.items) == 1 else f"{self.request_id}_{index}"

    # -- waking the owner ------------------------------------------------------------------
    def wake(self) -> None:
        if self._push is not None and self._defer is not None and self._wake.parked:
            if not self._push_queued:
                self._push_queued = True
                self._defer(self._run_push)
            return
        self._wake.set()

    def set_push(
        self,
        push: Callable[[], bool] | None,
        defer: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """While the owner sleeps between chunks, run ``push`` instead of waking it,
        through ``defer`` (the transport's ``at_pass_end``: at the end of the loop pass in
        which output arrived, after the worker link handed over all of its frame, so a
        chunk's end is there with its last tokens). ``push`` delivers what arrived
        itself (True), or declines (False) and the owner is woken. A push that polled
        output it does not deliver (an end, a failure) gives it to ``hand_back``, so that
        it reaches the owner's next ``wait``: no output is taken from the buffers without
        reaching the owner or the client. None: wake the owner for every chunk."""
        self._push, self._defer = push, defer

    def _run_push(self) -> None:
        self._push_queued = False
        push = self._push
        if push is not None and self._wake.parked:
            try:
                if push():
                    return
            except Exception:  # a bug of the push: the owner takes over, for good
                log.exception("request %s: pushing its output failed", self.request_id)
                self._push = None
        self._wake.set()

    def hand_back(self, changed: list[tuple[int, SampleOutput]]) -> None:
        self._handed_back.extend(changed)

    # -- opening: records, admission, submission -------------------------------------------
    def _open_records(self) -> None:
        """One record per prompt, registered (DuplicateRid: 400) and validated."""
        host = self.host
        route = self.origin.route if self.origin is not None else None
        for i, item in enumerate(self.req.items):
            rec = new_request(item.client_rid, self._item_request_id(i), route)
            try:
                host.opened(rec, self)
            except DuplicateRid:  # 400 with SGLang's message; traced by its request id
                rec = new_request(None, rec.request_id, route)
                host.opened(rec, self)
                self.runs.append(ItemRun(rec, item))
                raise
            self.runs.append(ItemRun(rec, item))
            rec.fire(Event.VALIDATE)

    def _admit(self) -> None:
        for run in self.runs:
            if not admit(run.rec, self.host.admission):
                raise ServeError(Cause.OVERLOADED, "The server is overloaded; retry later.")
            run.admitted = True

    def _submit(self, run: ItemRun, prompt: list[int]) -> None:
        """The prompt's samples and buffers, and its SUBMIT (unless it already ended)."""
        host, item, client = self.host, run.item, self.client
        assert item is not None and client is not None  # a rejection is never submitted
        sp = item.sampling
        max_new = check_lengths(
            len(prompt),
            0 if item.options.embed is not None else sp.max_new_tokens,
            context_length=host.model_config.context_length,
        )
        fmt, inside = prompt_reasoning(host.reasoning, item, prompt, host.tokenizer)
        budget = budget_option(item.reasoning_budget, fmt, inside, host.tokenizer)
        options = item.request_options(host.model_config.vocab_size, len(prompt), budget)
        dp_rank = host.dp_rank(client)
        opts = OutputOptions.of(item, options, host.weight_version, fmt, inside, dp_rank=dp_rank)
        base_id = item.client_rid or run.rec.request_id or uuid.uuid4().hex
        sinks: list[Sink] = []
        for j in range(sp.n):
            rid = base_id if sp.n == 1 else f"{base_id}_{j}"
            run.samples.append(SampleOutput(host.tokenizer, opts, prompt, rid))
            buf = OutputBuffer(max_new + host.output_margin)
            run.buffers.append(buf)
            sinks.append(_Sink(buf, run.rec, self))
        if run.ended is not None:  # ended while being tokenized: never submitted
            for sink in sinks:
                sink.finish(run.ended)
            return
        rec_id = run.rec.id
        run.sub = run.rec.submission = client.submit(
            prompt,
            {"max_new_tokens": 0} if item.options.embed is not None else sp.to_wire(max_new),
            options.to_wire(),
            sinks,
            on_dispatch=lambda: self._dispatched(run),
            on_release=lambda: host.worker_released(rec_id),
        )

    def _dispatched(self, run: ItemRun) -> None:
        run.rec.advance(Event.DISPATCH)  # refused once the request failed: nothing to do
        self._release_admission(run)

    def _release_admission(self, run: ItemRun) -> None:
        if run.admitted:
            run.admitted = False
            self.host.admission.release()

    # -- ending it from elsewhere ----------------------------------------------------------
    def abort(self, message: str, rec_id: int | None = None) -> None:
        """End the call's requests (or the one ``rec_id``) with finish_reason abort: the
        owner still reads their partial output and sends it."""
        for run in self.runs:
            if rec_id is not None and run.rec.id != rec_id:
                continue
            if run.sub is None:  # not submitted yet (being tokenized): it never will be
                run.ended = run.ended or {"type": Finish.ABORT, "message": message}
            elif self.client is not None:
                self.client.abort(run.sub, message=message)

    def interrupt(self, cause: Cause, message: str) -> None:
        """End every sample that has not ended with an explicit error the owner sends
        (an error event, a 503, a WebSocket error), and stop what the worker does."""
        failure = WorkerFailure(cause, message)
        for run in self.runs:
            for buf in run.buffers:
                buf.finish(failure)  # the first end wins: a finished sample keeps its own
            if run.sub is None:
                run.ended = run.ended or failure
            if run.sub is not None and self.client is not None:
                self.client.abort(run.sub, forget=True, message=message)
        self.wake()

    # -- progress --------------------------------------------------------------------------
    def poll(self) -> list[tuple[int, SampleOutput]]:
        """Drain every buffer; returns the samples that changed, with their batch index."""
        changed = []
        n_items = len(self.runs)
        for i, run in enumerate(self.runs):
            ended = False  # a sample of this run ended in this poll
            for j, sample in enumerate(run.samples):
                if sample.finish is not None or sample.failure is not None:
                    continue
                chunk = run.buffers[j].take_nowait()
                if chunk is None:
                    continue
                end = chunk.end
                try:
                    sample.consume(chunk)
                    if isinstance(end, dict):
                        sample.end(end)
                except (ValueError, TypeError, KeyError, IndexError) as exc:
                    self._bad_output(run, j, exc)
                    changed.append((j * n_items + i, sample))
                    ended = True
                    continue
                if chunk.ids and run.rec.state is not State.STREAMING:
                    run.rec.advance(Event.FIRST_TOKEN)  # running -> streaming, once
                if end is not None:
                    ended = True
                    if not isinstance(end, dict):
                        sample.failure = end
                changed.append((j * n_items + i, sample))
            if ended and all(s.finish or s.failure for s in run.samples):
                self._item_ended(run)
        return changed

    def _bad_output(self, run: ItemRun, j: int, exc: Exception) -> None:
        """A malformed output field (a worker bug) ends this sample with an explicit
        error, never the handler or the stream without one; the worker is told to stop."""
        log.error("request %d: malformed output from the worker: %s", run.rec.id, exc)
        run.samples[j].failure = WorkerFailure(Cause.INTERNAL, "the worker sent invalid output")
        if run.sub is not None and self.client is not None:
            self.client.abort_sample(run.sub, j, "invalid output")

    def _item_ended(self, run: ItemRun) -> None:
        rec = run.rec
        if rec.terminal:
            return
        for s in run.samples:
            if isinstance(s.failure, WorkerFailure):
                rec.fail(s.failure.cause, s.failure.message)
                return
        if any(s.finish.get("type") == Finish.ABORT for s in run.samples):
            rec.fail(Cause.ABORTED, "aborted")
        elif not rec.advance(Event.FINISH, grammar_detail(run.samples)):
            rec.fail(Cause.INTERNAL, f"finished in state {rec.state.value}")

    def _take_progress(self, woke: bool) -> list[tuple[int, SampleOutput]]:
        """What changed since the owner last looked: first what a push polled and handed
        back (each sample once), then the buffers (polled only after a wake-up)."""
        changed = self.poll() if woke else []
        if self._handed_back:
            back, self._handed_back = self._handed_back, []
            seen = {id(s) for _, s in back}
            changed = back + [c for c in changed if id(c[1]) not in seen]
        return changed

    @property
    def done(self) -> bool:
        runs = self.runs
        if len(runs) == 1:  # the common call (asked on every chunk): no generator
            return runs[0].rec.terminal
        return all(r.rec.terminal for r in runs)

    def error(self) -> tuple[Cause, str] | None:
        """The first failure that is not an abort (the whole call reports it)."""
        for run in self.runs:
            c = run.rec.cause
            if c is not None and c is not Cause.ABORTED:
                return c, run.rec.detail or c.value
        return None

    def samples(self) -> list[SampleOutput]:
        """In SGLang's order: n copies of the batch, ``[p0, p1, ..., p0, p1, ...]``."""
        n = max(len(r.samples) for r in self.runs) if self.runs else 0
        return [r.samples[j] for j in range(n) for r in self.runs if j < len(r.samples)]

    def end_pending(self) -> bool:
        """Whether a sample's buffer holds its end (delivered or not)."""
        return any(buf.ended for run in self.runs for buf in run.buffers)

    # -- every exit ------------------------------------------------------------------------
    def close(self, cause: Cause = Cause.INTERNAL, detail: str | None = None) -> None:
        """The one exit (idempotent): terminal state, abort what the worker holds, return
        the admission slot, leave the registry and the live calls (``CallHost.closed``).
        ``cause`` applies to records still live."""
        if self.closed:
            return
        self.closed = True
        log.debug("close %s (%s: %s)", [r.rec for r in self.runs], cause.value, detail)
        for run in self.runs:
            run.rec.fail(cause, detail)  # refused (False) for a record already ended
            if run.sub is not None and self.client is not None:
                self.client.abort(run.sub, forget=True, message=detail or cause.value)
            self._release_admission(run)
        self.host.closed(self)
