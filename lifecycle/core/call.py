"""One generate call, the one owner of its requests, from admission to its last chunk:
the driver that awaits around the call's sans-I/O state (``lifecycle.core.call_state``).

A ``GenerateCall`` is a ``CallState`` (one ``ItemRun`` per prompt, ``n`` samples each,
every sample with its own ``OutputBuffer``) plus what awaits: loading the model,
tokenizing the prompts, sleeping until the worker link wakes it, and its deadline, on
the event loop's clock. Its scope is entered before anything can fail::

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
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any, Protocol

import anyio

from lifecycle.core.call_state import CallHost, CallState, ItemRun
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.fsm import new_request
from lifecycle.core.outputs import SampleOutput
from lifecycle.core.params import GenerateRequest
from lifecycle.core.states import Cause

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


class GenerateCall(CallState):
    def __init__(
        self,
        host: CallHost,
        req: GenerateRequest,
        exit_cause: ExitCause = owner_left,
        timeout: float | None = None,
    ) -> None:
        super().__init__(host, req)
        self.exit_cause = exit_cause
        self.started_ns = time.monotonic_ns()
        # Seconds from the start this call may take (its request's X-Request-Timeout
        # header, else the server's --request-timeout); past them it ends deadline (504).
        self.timeout = timeout
        self._t0 = math.inf  # when start() began, on the event loop's clock
        self._expired = False  # ended at its deadline by the frontend's watch
        # Seconds it waited, admitted, for its model to load on demand (None: it did not).
        self.model_wait: float | None = None

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
        request = self.origin.call_request if self.origin is not None else None
        if request is None:
            return
        raw = next((v for k, v in request.headers.raw if k == TIMEOUT_HEADER), None)
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
        self._open_records()
        loading = host.must_load()  # its model is not loaded: admitted, it waits for it
        if not loading:
            self.client = host.ready_client()
        self._admit()
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

    # -- progress --------------------------------------------------------------------------
    async def wait(self) -> list[tuple[int, SampleOutput]]:
        """Wait for progress; returns what changed (empty only when the call is done).

        The buffers are polled only after a wake-up: everything that adds to them or ends
        them wakes the call (the sinks, ``interrupt``), so a call that returned a chunk a
        moment ago does not look at its buffers again before it sleeps."""
        woke = self._wake.take()
        while True:
            changed = self._take_progress(woke)
            woke = True
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
    origin = call.origin
    rec = new_request(None, call.request_id, origin.route if origin is not None else None)
    host.opened(rec, call)
    call.runs.append(ItemRun(rec, None))
    call.http_status = status if status != cause.status else None
    call.close(cause, message)
    return call
