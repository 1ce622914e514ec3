"""One generate call, the one owner of its requests, from admission to its last chunk.

A ``GenerateCall`` holds one ``RequestRecord`` per prompt (a batch has several), ``n``
samples each, every sample with its own ``OutputBuffer``. Its scope is entered before
anything can fail::

    async with frontend.call(req, exit_cause=..., owner=...) as call:
        await call.start()
        ...

The call closes itself once every record has ended (``wait`` sees it first), before
its owner sends the last of it, so the rid is free by then; faces never close a call.
Leaving that scope for any reason (finish, error, the client leaving, cancellation, a
bug that raises) closes the call: every record reaches exactly one terminal state, what
the worker still holds is aborted (the record stays a tombstone in the registry until
the worker's terminal entry confirms release), the admission slot is returned and the
call leaves the live calls. Nothing depends on a generator having started or a callback
having been registered in time. What a call needs of the process is its ``CallHost``
(the ``Frontend``).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import Any, Protocol

import anyio

from lifecycle.core.buffers import AdmissionQueue, OutputBuffer
from lifecycle.core.detok import TextCodec, TokenizerLike
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.fsm import RequestRecord, admit, new_request
from lifecycle.core.origin import CALL_ORIGIN, EXCHANGE, Exchange, new_request_id
from lifecycle.core.outputs import OutputOptions, SampleOutput, grammar_detail, prompt_reasoning
from lifecycle.core.params import GenerateItem, GenerateRequest, check_lengths
from lifecycle.core.ports import WorkerLink
from lifecycle.core.reasoning import ReasoningFormat, budget_option
from lifecycle.core.registry import DuplicateRid
from lifecycle.core.states import Cause, Event, State
from lifecycle.core.submission import Sink, Submission, WorkerFailure
from lifecycle.core.wakeup import Wakeup
from wire import Finish

__all__ = [
    "TIMEOUT_HEADER",
    "CallHost",
    "ExitCause",
    "GenerateCall",
    "RejectHost",
    "owner_left",
    "reject",
]

TIMEOUT_HEADER = b"x-request-timeout"  # a request's own deadline, in seconds

log = logging.getLogger("lifecycle.core.call")

# Why the owner left a call that had not ended: asked when its scope exits.
ExitCause = Callable[[], tuple[Cause, str]]


def owner_left() -> tuple[Cause, str]:
    """The default ``ExitCause``: an owner that leaves without saying why is a bug."""
    return Cause.INTERNAL, "the call's owner left before it ended"


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

    def opened(self, rec: RequestRecord, call: GenerateCall) -> None: ...

    def worker_released(self, rec_id: int) -> None: ...

    def closed(self, call: GenerateCall) -> None: ...


class _Sink:
    """One sample's wire sink: its buffer plus the call's wake-up and token counter."""

    __slots__ = ("buffer", "rec", "call")

    def __init__(self, buffer: OutputBuffer, rec: RequestRecord, call: GenerateCall) -> None:
        self.buffer, self.rec, self.call = buffer, rec, call

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> None:
        self.buffer.append(ids, extra)
        self.rec.tokens += len(ids)
        self.call.wake()

    def finish(self, reason: Any) -> None:
        self.buffer.finish(reason)
        self.call.wake()


class _ItemRun:
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


class GenerateCall:
    def __init__(
        self,
        host: CallHost,
        req: GenerateRequest,
        exit_cause: ExitCause = owner_left,
        timeout: float | None = None,
    ) -> None:
        self.host = host
        self.req = req
        self.exit_cause = exit_cause
        self.runs: list[_ItemRun] = []
        self.client: WorkerLink | None = None
        self._wake = Wakeup()
        self.started_ns = time.monotonic_ns()
        self.closed = False
        # Seconds from the start this call may take (its request's X-Request-Timeout
        # header, else the server's --request-timeout); past them it ends deadline (504).
        self.timeout = timeout
        self._t0 = math.inf  # when start() began, on the event loop's clock
        self._expired = False  # ended at its deadline by the frontend's watch
        # The HTTP exchange it is made for (None for the Engine): its request id names the
        # call's records (``X-Request-Id``; the body's rid when the client sent no header).
        self.exchange: Exchange | None = EXCHANGE.get()
        self.http_status: int | None = None  # a rejection's status, when not its cause's
        self.request_id = self._name_exchange(req)
        # What the owner may run at a wake-up instead of waking (``set_push``), and what
        # a push polled but left to the owner (``hand_back``).
        self._push: Callable[[], bool] | None = None
        self._defer: Callable[[Callable[[], None]], None] | None = None  # runs the push
        self._push_queued = False
        self._handed_back: list[tuple[int, SampleOutput]] = []
        # Seconds it waited, admitted, for its model to load on demand (None: it did not).
        self.model_wait: float | None = None

    def _name_exchange(self, req: GenerateRequest) -> str:
        ex = self.exchange
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

    # -- the owner's scope -----------------------------------------------------------------
    async def __aenter__(self) -> GenerateCall:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.closed:
            return
        if isinstance(exc, (RequestError, ServeError)):
            self.close(exc.cause, exc.message)
        else:  # returned early, cancelled, the connection went away, or a bug raised
            cause, detail = self.exit_cause()
            if isinstance(exc, Exception) and cause is Cause.INTERNAL:
                log.error("request handler failed: %r", exc)  # a bug: ends internal, no leak
                detail = f"handler failed: {type(exc).__name__}"
            self.close(cause, detail)

    # -- start: validate, admit, tokenize, submit -------------------------------------------
    async def start(self) -> None:
        """Raises RequestError (400) or ServeError; the records are failed with their
        cause before it propagates (the scope's exit then only tidies up)."""
        self._t0 = anyio.current_time()
        try:
            self._take_origin_timeout()
            with anyio.move_on_after(self._remaining()) as scope:
                await self._start()
            if scope.cancelled_caught:
                raise ServeError(Cause.DEADLINE, self._deadline_message())
        except (RequestError, ServeError) as exc:
            self.close(exc.cause, exc.message)
            raise

    def _take_origin_timeout(self) -> None:
        """The HTTP request's own ``X-Request-Timeout`` (seconds), over the default."""
        origin = CALL_ORIGIN.get()
        if origin is None:
            return
        raw = next((v for k, v in origin.headers.raw if k == TIMEOUT_HEADER), None)
        if raw is None:
            return
        try:
            timeout = float(raw)
        except ValueError:
            timeout = math.nan
        if not (math.isfinite(timeout) and timeout > 0):
            raise RequestError(
                f"X-Request-Timeout must be a positive number of seconds, got {raw.decode()!r}"
            )
        self.timeout = timeout

    def _remaining(self) -> float:
        if self.timeout is None:
            return math.inf
        return self._t0 + self.timeout - anyio.current_time()

    def _deadline_message(self) -> str:
        return f"the request's deadline passed ({self.timeout:g} s)"

    def expire_if_overdue(self) -> bool:
        """End the call at its deadline wherever its owner waits: ``wait`` checks it,
        and this (the frontend's deadline watch) covers an owner blocked elsewhere, in a
        write to a client that does not read, while the worker would go on generating.
        True the one time it ends the call."""
        if self._expired or self.timeout is None or self.done or self._remaining() > 0:
            return False
        self._expired = True
        self.interrupt(Cause.DEADLINE, self._deadline_message())
        return True

    async def _start(self) -> None:
        host = self.host
        route = self.exchange.route if self.exchange is not None else None
        for i, item in enumerate(self.req.items):
            rec = new_request(item.client_rid, self._item_request_id(i), route)
            try:
                host.opened(rec, self)
            except DuplicateRid:  # 400 with SGLang's message; traced by its request id
                rec = new_request(None, rec.request_id, route)
                host.opened(rec, self)
                self.runs.append(_ItemRun(rec, item))
                raise
            self.runs.append(_ItemRun(rec, item))
            rec.fire(Event.VALIDATE)
        loading = host.must_load()  # its model is not loaded: admitted, it waits for it
        if not loading:
            self.client = host.ready_client()
        for run in self.runs:
            if not admit(run.rec, host.admission):
                raise ServeError(Cause.OVERLOADED, "The server is overloaded; retry later.")
            run.admitted = True
        if loading:
            t0 = anyio.current_time()
            try:
                await host.load_model()  # ServeError naming the model when it cannot load
            finally:
                self.model_wait = anyio.current_time() - t0
            self.client = host.ready_client()
        items = [r.item for r in self.runs if r.item is not None]
        texts = [item.text or "" for item in items if item.input_ids is None]
        encoded = iter(await host.codec.encode(texts) if texts else [])
        prompts = [
            list(item.input_ids if item.input_ids is not None else next(encoded)) for item in items
        ]
        if prompts:  # the router sees the prompt (one worker for the whole call)
            self.client = host.ready_client(prompts[0])
        for run, prompt in zip(self.runs, prompts, strict=True):
            self._submit(run, prompt)

    def _submit(self, run: _ItemRun, prompt: list[int]) -> None:
        host, item = self.host, run.item
        assert item is not None  # a rejection is never submitted
        sp = item.sampling
        max_new = check_lengths(
            len(prompt),
            0 if item.embed is not None else sp.max_new_tokens,
            context_length=host.model_config.context_length,
        )
        fmt, inside = prompt_reasoning(host.reasoning, item, prompt, host.tokenizer)
        budget = budget_option(item.reasoning_budget, fmt, inside, host.tokenizer)
        options = item.request_options(host.model_config.vocab_size, len(prompt), budget)
        assert self.client is not None
        opts = OutputOptions.of(
            item, host.weight_version, fmt, inside, dp_rank=host.dp_rank(self.client)
        )
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
        run.sub = run.rec.submission = self.client.submit(
            prompt,
            {"max_new_tokens": 0} if item.embed is not None else sp.to_wire(max_new),
            options.to_wire(),
            sinks,
            on_dispatch=lambda: self._dispatched(run),
            on_release=lambda: host.worker_released(rec_id),
        )

    def _dispatched(self, run: _ItemRun) -> None:
        run.rec.advance(Event.DISPATCH)  # refused once the request failed: nothing to do
        self._release_admission(run)

    def _release_admission(self, run: _ItemRun) -> None:
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

    def _bad_output(self, run: _ItemRun, j: int, exc: Exception) -> None:
        """A malformed output field (a worker bug) ends this sample with an explicit
        error, never the handler or the stream without one; the worker is told to stop."""
        log.error("request %d: malformed output from the worker: %s", run.rec.id, exc)
        run.samples[j].failure = WorkerFailure(Cause.INTERNAL, "the worker sent invalid output")
        if run.sub is not None and self.client is not None:
            self.client.abort_sample(run.sub, j, "invalid output")

    def _item_ended(self, run: _ItemRun) -> None:
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

    @property
    def done(self) -> bool:
        runs = self.runs
        if len(runs) == 1:  # the common call (asked on every chunk): no generator
            return runs[0].rec.terminal
        return all(r.rec.terminal for r in runs)

    async def wait(self) -> list[tuple[int, SampleOutput]]:
        """Wait for progress; returns what changed (empty only when the call is done).

        The buffers are polled only after a wake-up: everything that adds to them or ends
        them wakes the call (``_Sink``, ``interrupt``), so a call that returned a chunk a
        moment ago does not look at its buffers again before it sleeps."""
        woke = self._wake.take()
        while True:
            changed = self.poll() if woke else []
            woke = True
            if self._handed_back:  # first what a push polled, each sample once
                back, self._handed_back = self._handed_back, []
                seen = {id(s) for _, s in back}
                changed = back + [c for c in changed if id(c[1]) not in seen]
            if self.done:
                self.close()  # every record ended: the rid is free before the owner sends
                return changed
            if changed:
                return changed
            if self.timeout is None:  # the common case: no cancel scope per wake-up
                await self._wake.wait()
            else:
                with anyio.move_on_after(self._remaining()):
                    await self._wake.wait()
                if self._remaining() <= 0 and not self.done:
                    self.interrupt(Cause.DEADLINE, self._deadline_message())
                    continue

    async def run_to_end(self) -> None:
        while not self.done:
            await self.wait()

    async def result(self) -> list[SampleOutput]:
        """Run to the end; every sample in SGLang's order (``samples``), or ServeError with
        the first failure that is not an abort (``error``)."""
        await self.run_to_end()
        err = self.error()
        if err is not None:
            raise ServeError(*err)
        return self.samples()

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

    def e2e(self) -> float:
        return (time.monotonic_ns() - self.started_ns) / 1e9

    async def frames(
        self, incremental: bool
    ) -> AsyncIterator[tuple[int, SampleOutput, dict[str, Any]]]:
        while not self.closed:  # wait() closes the call once it is done
            for item in self.render(await self.wait(), incremental):
                yield item

    def render(
        self, changed: list[tuple[int, SampleOutput]], incremental: bool
    ) -> list[tuple[int, SampleOutput, dict[str, Any]]]:
        """The stream frames of what ``wait`` returned. A sample that failed still sends
        what it got before the failure (a lagging reader's last chunk holds it), then the
        owner sends the error."""
        e2e = self.e2e()
        return [(index, sample, sample.frame(incremental, e2e)) for index, sample in changed
                if sample.failure is None or len(sample.ids) > sample.sent_ids]  # fmt: skip

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


class RejectHost(CallHost, Protocol):
    """A ``CallHost`` that makes calls (``lifecycle.core.frontend.Frontend``)."""

    def call(self, req: GenerateRequest, exit_cause: ExitCause | None = None) -> GenerateCall: ...


_NOTHING = GenerateRequest(items=[], is_batch=False, stream=False)


def reject(host: RejectHost, cause: Cause, message: str, status: int | None = None) -> GenerateCall:
    """Record a request refused before it became a call of its own (a body that is not
    JSON, a field of the wrong type, an unknown field under ``--strict-fields``, empty
    ``messages``, a missing API key): one record, failed at once from ``received`` with
    ``cause``, so that it ends like any other request: a trace (route, cause, message,
    client), a line in the access log, a count in the metrics. ``status``: the HTTP
    status it got, when it is not the cause's (a 413, a 401)."""
    call = host.call(_NOTHING)
    ex = call.exchange
    rec = new_request(None, call.request_id, ex.route if ex is not None else None)
    host.opened(rec, call)
    call.runs.append(_ItemRun(rec, None))
    call.http_status = status if status != cause.status else None
    call.close(cause, message)
    return call
