"""The request path between an API handler and the worker, without HTTP.

``Frontend`` holds the process-wide parts (registry of live requests, admission queue,
tokenizer, the supervised worker). ``GenerateCall`` is one generate call: one
``RequestRecord`` per prompt (a batch has several), ``n`` samples each, every sample with
its own ``OutputBuffer``. The caller owns the call in one task scope and must ``close``
it on every exit: close drives each record to exactly one terminal state, aborts what the
worker still holds (the record stays a tombstone in the registry until the worker's
terminal entry confirms release) and returns the admission slot.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from lifecycle.buffers import AdmissionQueue, OutputBuffer
from lifecycle.detok import TextCodec, TokenizerLike
from lifecycle.errors import RequestError
from lifecycle.fsm import Registry, RequestRecord, admit, new_request
from lifecycle.outputs import OutputOptions, SampleOutput
from lifecycle.params import GenerateItem, GenerateRequest, check_lengths
from lifecycle.states import Cause, Event, State
from lifecycle.supervisor import Supervisor
from lifecycle.worker_client import WorkerClient, WorkerFailure
from wire import pack_ids

__all__ = ["Frontend", "FrontendConfig", "GenerateCall", "ServeError"]

log = logging.getLogger("lifecycle.frontend")

_FAILURE_CAUSE = {
    "worker_lost": Cause.WORKER_LOST,
    "too_long": Cause.TOO_LONG,
    "invalid": Cause.INVALID,
}


@dataclass(frozen=True, slots=True)
class FrontendConfig:
    max_queued: int = 1024  # admitted and not yet dispatched; beyond: 503 + Retry-After
    incremental_streaming_output: bool = False
    output_margin: int = 8  # OutputBuffer limit = max_new_tokens + margin


class ServeError(Exception):
    """A request ended by the server side (not ready, overloaded, worker lost, ...)."""

    def __init__(self, cause: Cause, message: str) -> None:
        super().__init__(message)
        self.cause = cause
        self.message = message


class Frontend:
    def __init__(
        self,
        supervisor: Supervisor,
        tokenizer: TokenizerLike,
        model_config: Any,
        config: FrontendConfig = FrontendConfig(),
    ) -> None:
        self.config = config
        self.supervisor = supervisor
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.registry = Registry()
        self.admission = AdmissionQueue(config.max_queued)
        self.codec = TextCodec(tokenizer)
        self.received = 0  # records that entered the registry; each ends finished or failed
        self.finished = 0
        self.failed: dict[str, int] = {}
        # Called once per call, after close() has driven every record to its terminal state
        # (metrics count there, never per token).
        self.close_observers: list[Callable[[GenerateCall], None]] = []

    def ready_client(self) -> WorkerClient:
        client = self.supervisor.client
        if not self.supervisor.ready or client is None:
            raise ServeError(Cause.NOT_READY, "The server is not ready yet; retry later.")
        return client

    def generate(self, req: GenerateRequest) -> GenerateCall:
        return GenerateCall(self, req)

    def count(self, rec: RequestRecord) -> None:
        if rec.state is State.DONE:
            self.finished += 1
        elif rec.cause is not None:
            self.failed[rec.cause.value] = self.failed.get(rec.cause.value, 0) + 1


class _Sink:
    """One sample's wire sink: its buffer plus the call's wake-up and release books."""

    __slots__ = ("buffer", "run", "call", "dropped")

    def __init__(self, buffer: OutputBuffer, run: _ItemRun, call: GenerateCall) -> None:
        self.buffer, self.run, self.call, self.dropped = buffer, run, call, False

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> None:
        if not self.dropped:
            self.buffer.append(ids, extra)
            self.run.rec.tokens += len(ids)
            self.call.wake()

    def finish(self, reason: Any) -> None:
        self.buffer.finish(reason)
        run = self.run
        run.open_samples -= 1
        if run.open_samples == 0:  # the worker holds nothing more for this record
            self.call.frontend.registry.worker_released(run.rec.id)
        self.call.wake()


class _ItemRun:
    __slots__ = ("rec", "item", "samples", "buffers", "sinks", "rids", "open_samples", "admitted")

    def __init__(self, rec: RequestRecord, item: GenerateItem) -> None:
        self.rec = rec
        self.item = item
        self.samples: list[SampleOutput] = []
        self.buffers: list[OutputBuffer] = []
        self.sinks: list[_Sink] = []
        self.rids: list[int] = []
        self.open_samples = 0
        self.admitted = False


class GenerateCall:
    def __init__(self, frontend: Frontend, req: GenerateRequest) -> None:
        self.frontend = frontend
        self.req = req
        self.runs: list[_ItemRun] = []
        self.client: WorkerClient | None = None
        self._wake = anyio.Event()
        self.started_ns = time.monotonic_ns()
        self.closed = False

    def wake(self) -> None:
        self._wake.set()

    # -- start: validate, admit, tokenize, submit -------------------------------------------
    async def start(self) -> None:
        """Raises RequestError (400) or ServeError; the caller closes the call either way."""
        fe = self.frontend
        for item in self.req.items:
            rec = new_request(item.client_rid)
            fe.registry.add(rec)  # DuplicateRid: 400 with SGLang's message
            fe.received += 1
            self.runs.append(_ItemRun(rec, item))
            rec.fire(Event.VALIDATE)
        self.client = fe.ready_client()
        for run in self.runs:
            if not admit(run.rec, fe.admission):
                raise ServeError(Cause.OVERLOADED, "The server is overloaded; retry later.")
            run.admitted = True
        texts = [r.item.text or "" for r in self.runs if r.item.input_ids is None]
        encoded = iter(await fe.codec.encode(texts) if texts else [])
        for run in self.runs:
            prompt = run.item.input_ids if run.item.input_ids is not None else next(encoded)
            self._submit(run, list(prompt))

    def _submit(self, run: _ItemRun, prompt: list[int]) -> None:
        fe, item = self.frontend, run.item
        sp = item.sampling
        max_new = check_lengths(
            len(prompt), sp.max_new_tokens, context_length=fe.model_config.context_length
        )
        opts = OutputOptions(
            return_logprob=item.return_logprob,
            logprob_start_len=item.logprob_start_len,
            top_logprobs_num=item.top_logprobs_num,
            token_ids_logprob=tuple(item.token_ids_logprob) if item.token_ids_logprob else None,
            return_text_in_logprobs=item.return_text_in_logprobs,
            return_hidden_states=item.return_hidden_states,
            skip_special_tokens=sp.skip_special_tokens,
            stops=tuple(sp.stop),
            no_stop_trim=sp.no_stop_trim,
        )
        base_id = item.client_rid or uuid.uuid4().hex
        for j in range(sp.n):
            rid = base_id if sp.n == 1 else f"{base_id}_{j}"
            run.samples.append(SampleOutput(fe.tokenizer, opts, prompt, rid))
            buf = OutputBuffer(max_new + fe.config.output_margin)
            run.buffers.append(buf)
            run.sinks.append(_Sink(buf, run, self))
        run.open_samples = sp.n
        options = _wire_options(item)
        assert self.client is not None
        run.rids = self.client.submit(
            prompt, sp.to_wire(max_new), options, list(run.sinks), lambda: self._dispatched(run)
        )

    def _dispatched(self, run: _ItemRun) -> None:
        if run.rec.state is State.QUEUED:
            run.rec.fire(Event.DISPATCH)
        self._release_admission(run)

    def _release_admission(self, run: _ItemRun) -> None:
        if run.admitted:
            run.admitted = False
            self.frontend.admission.release()

    # -- progress --------------------------------------------------------------------------
    def poll(self) -> list[tuple[int, SampleOutput]]:
        """Drain every buffer; returns the samples that changed, with their batch index."""
        changed = []
        n_items = len(self.runs)
        for i, run in enumerate(self.runs):
            for j, (buf, sample) in enumerate(zip(run.buffers, run.samples, strict=True)):
                if sample.finish is not None or sample.failure is not None:
                    continue
                chunk = buf.take_nowait()
                if chunk is None:
                    continue
                try:
                    sample.consume(chunk)
                except (ValueError, TypeError, KeyError, IndexError) as exc:
                    self._bad_output(run, j, exc)
                    changed.append((j * n_items + i, sample))
                    continue
                if chunk.ids and run.rec.state is State.RUNNING:
                    run.rec.fire(Event.FIRST_TOKEN)
                if chunk.end is not None:
                    if isinstance(chunk.end, dict):
                        sample.end(chunk.end)
                    else:
                        sample.failure = chunk.end
                changed.append((j * n_items + i, sample))
            if run.samples and all(s.finish or s.failure for s in run.samples):
                self._item_ended(run)
        return changed

    def _bad_output(self, run: _ItemRun, j: int, exc: Exception) -> None:
        """A malformed output field (a worker bug) ends this sample with an explicit
        error, never the handler or the stream without one; the worker is told to stop."""
        log.error("request %d: malformed output from the worker: %s", run.rec.id, exc)
        run.samples[j].failure = WorkerFailure("internal", "the worker sent invalid output")
        run.sinks[j].dropped = True
        if not run.buffers[j].ended and self.client is not None and j < len(run.rids):
            self.client.abort([run.rids[j]], message="invalid output")

    def _item_ended(self, run: _ItemRun) -> None:
        rec = run.rec
        if rec.terminal:
            return
        for s in run.samples:
            if isinstance(s.failure, WorkerFailure):
                rec.fail(_FAILURE_CAUSE.get(s.failure.code, Cause.INTERNAL), s.failure.message)
                return
        if any(s.finish.get("type") == "abort" for s in run.samples):
            rec.fail(Cause.ABORTED, "aborted")
        elif rec.state in (State.RUNNING, State.STREAMING):
            rec.fire(Event.FINISH)
        else:
            rec.fail(Cause.INTERNAL, f"ended in state {rec.state.value}")

    @property
    def done(self) -> bool:
        return all(r.rec.terminal for r in self.runs)

    async def wait(self) -> list[tuple[int, SampleOutput]]:
        """Wait for progress; returns what changed (empty only when the call is done)."""
        while True:
            changed = self.poll()
            if changed or self.done:
                return changed
            await self._wake.wait()
            self._wake = anyio.Event()

    async def run_to_end(self) -> None:
        while not self.done:
            await self.wait()

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
        while not self.done:
            for index, sample in await self.wait():
                if sample.failure is None:
                    yield index, sample, sample.frame(incremental, self.e2e())

    # -- every exit ------------------------------------------------------------------------
    def close(self, cause: Cause = Cause.INTERNAL, detail: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        log.debug("close %s (%s: %s)", [r.rec for r in self.runs], cause.value, detail)
        fe = self.frontend
        for run in self.runs:
            rec = run.rec
            if not rec.terminal:
                rec.fail(cause, detail)
            live = [r for r, b in zip(run.rids, run.buffers, strict=False) if not b.ended]
            for s in run.sinks:
                s.dropped = True
            if live and self.client is not None:
                self.client.abort(live, message=detail or cause.value)
            self._release_admission(run)
            fe.registry.remove(rec)  # stays a tombstone while the worker holds it
            fe.count(rec)
        for observe in fe.close_observers:
            try:
                observe(self)
            except Exception:  # an observer's bug must not leak the request
                log.exception("close observer failed")


def _wire_options(item: GenerateItem) -> dict[str, Any]:
    o: dict[str, Any] = {}
    if item.return_logprob:
        o["return_logprob"] = True
        o["logprob_start_len"] = item.logprob_start_len
        if item.top_logprobs_num:
            o["top_logprobs_num"] = item.top_logprobs_num
        if item.token_ids_logprob:
            o["token_ids_logprob"] = pack_ids(item.token_ids_logprob)
    if item.return_hidden_states:
        o["return_hidden_states"] = True
    return o


def request_error_cause(exc: RequestError) -> Cause:
    return Cause.INVALID if exc.status == 400 else Cause.INTERNAL
