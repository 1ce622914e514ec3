"""OpenTelemetry export: one OTLP/HTTP span per request, from ``received`` to its terminal
state, with one span event per transition (docs/tracing.md, "OpenTelemetry").

``OtlpExporter`` watches the frontend twice per call. When a call is made (an open
observer, in the task of the HTTP request it came from) it keeps the request's path and
raw headers; the export thread reads the W3C ``traceparent`` from them, so the span joins
the caller's trace. When the call is closed (a close observer: every record terminal) it
copies what the span needs (the record's trace list, token counts, the sampling
parameters) into one tuple and appends it to a bounded deque. That is all the event loop
pays (measured alone: 0.9 us when the call is made, 3 us at close).

Building the span and encoding it happen in the export thread, because they cost more
than the budget a request can spare (measured: an SDK ``Span`` through the
``TracerProvider`` 78 us, a bare ``ReadableSpan`` 15-20 us, its protobuf encoding about
85 us; a request's whole frontend CPU is a few hundred). Every ``interval`` (or sooner
when a batch is full) the thread turns up to ``batch_size`` pending requests into the
SDK's ``ReadableSpan`` objects and hands them to the official ``OTLPSpanExporter``. When
the collector does not answer, the deque keeps the latest ``max_queue`` requests and
drops the oldest, unbuilt, and the thread sends one span per interval until one goes
through: an unreachable collector costs the loop an append. The
exporter's own per-batch log lines are swallowed; this module logs one warning when
export starts failing and one line when it works again.

Span times are the trace's own: the record's ``monotonic_ns`` edge times plus one
wall-clock offset measured when the exporter starts, so the span and its events line up
with ``/debug/requests/{id}`` and the trace log. Attributes follow the OpenTelemetry GenAI
semantic conventions where they have a name (``gen_ai.*``), and ours (``lifecycle.*``)
carry what they have none for.

The SDK is the optional ``otel`` extra and is imported only when export is on
(``check_endpoint`` says clearly when it is missing).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple
from urllib.parse import urlsplit

from lifecycle.core.fsm import RawEntry
from lifecycle.core.sampling import SamplingRequest
from lifecycle.core.states import Cause, Event, State
from lifecycle.core.version import __version__
from lifecycle.tracing.store import detail_json

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext

    from lifecycle.core.call import GenerateCall
    from lifecycle.core.frontend import Frontend

__all__ = ["OtlpConfig", "OtlpExporter", "OtlpUnavailable", "check_endpoint"]

log = logging.getLogger("lifecycle.tracing.otel")

# The SDK exporter logs every failed batch and every retry here; we log once instead.
_SDK_LOGGER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
_EXTRA = "pip install 'lifecycle[otel]'"

# gen_ai.operation.name by the path a call came in on; anything else is a completion.
_OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/embeddings": "embeddings",
    "/encode": "embeddings",
}


class OtlpUnavailable(ValueError):
    """``--otlp-traces-endpoint`` cannot be used: not an http(s) URL, or no otel extra."""


def check_endpoint(url: str) -> str:
    """The URL to post spans to (``/v1/traces`` added to a bare collector address, as in
    the OTLP/HTTP spec's default path); raises OtlpUnavailable with what to do."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise OtlpUnavailable(
            f"--otlp-traces-endpoint {url!r}: expected an OTLP/HTTP URL such as "
            "http://127.0.0.1:4318/v1/traces"
        )
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise OtlpUnavailable(
            f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter, which "
            f"this install lacks ({exc}); install the otel extra: {_EXTRA}"
        ) from None
    return url.rstrip("/") + "/v1/traces" if parts.path in ("", "/") else url


@dataclass(frozen=True, slots=True)
class OtlpConfig:
    endpoint: str  # the OTLP/HTTP traces URL (check_endpoint)
    service_name: str = "lifecycle"
    model: str | None = None  # gen_ai.request.model
    max_queue: int = 2048  # ended requests waiting for export; past it the oldest go
    batch_size: int = 512  # spans per export request
    interval: float = 1.0  # seconds between exports (sooner when a batch is full)
    timeout: float = 10.0  # one export request, the exporter's retries included
    close_timeout: float = 5.0  # what close() waits for the last spans to go out


class _Ended(NamedTuple):
    """One terminal record, as the loop copies it at close: plain values and immutable
    objects, nothing that holds the call (its prompt or output) alive until export."""

    rec_id: int
    rid: str | None
    created_ns: int
    trace: list[RawEntry]  # the record's own list: terminal, so it no longer changes
    state: State
    cause: Cause | None
    message: str | None
    origin: tuple[str, list[tuple[bytes, bytes]]]  # the request's path and raw headers
    sampling: SamplingRequest | None  # None: refused before it was parsed
    embed: bool
    prompt_tokens: int | None
    output_tokens: int
    cached_tokens: int
    finish_reasons: list[str]
    worker: str | None


_NO_ORIGIN: tuple[str, list[tuple[bytes, bytes]]] = ("", [])


class OtlpExporter:
    """Frontend observer and owner of the export thread; ``install`` then ``close``."""

    def __init__(
        self, config: OtlpConfig, *, worker: Callable[[], str | None] = lambda: None
    ) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.config = config
        self.worker = worker
        self.offset_ns = time.time_ns() - time.monotonic_ns()  # one clock pair, as the tracer
        self._sdk = OTLPSpanExporter(endpoint=config.endpoint, timeout=config.timeout)
        self._resource = Resource.create(
            {"service.name": config.service_name, "service.version": __version__}
        )
        self._scope = InstrumentationScope("lifecycle", __version__)
        self._ids = RandomIdGenerator()
        self._propagator = TraceContextTextMapPropagator()
        self._origins: weakref.WeakKeyDictionary[
            GenerateCall, tuple[str, list[tuple[bytes, bytes]]]
        ]
        self._origins = weakref.WeakKeyDictionary()
        self._queue: deque[_Ended] = deque(maxlen=config.max_queue)
        self._wake = threading.Event()  # a full batch is waiting
        self._stopped = threading.Event()  # close() was called
        self._stopping = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="lifecycle-otlp", daemon=True)
        self._silencer = _Silencer(self)
        self.failing = False  # the last export failed (and was logged once)
        self.exported = 0  # spans the collector took
        self.pushed_out = 0  # ended requests the full queue pushed out (the loop counts)
        self.failed_spans = 0  # spans in batches that failed (the export thread counts)
        self.unsampled = 0  # requests whose caller's traceparent says not sampled

    @property
    def dropped(self) -> int:
        """Ended requests that were never exported (queue full, or their batch failed)."""
        return self.pushed_out + self.failed_spans

    # -- installation ---------------------------------------------------------------------
    def install(self, frontend: Frontend) -> None:
        frontend.events.subscribe(self)
        logging.getLogger(_SDK_LOGGER).addFilter(self._silencer)
        self._thread.start()
        log.info("exporting request spans to %s", self.config.endpoint)

    def close(self) -> None:
        """Export what is queued (waiting at most ``close_timeout``; not at all while the
        collector is failing), then stop the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stopping = True
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive() and not self.failing:
            self._thread.join(self.config.close_timeout)
        self._sdk.shutdown()  # ends a retry wait at once; later exports fail fast
        if self._thread.is_alive():
            self._thread.join(1.0)
        logging.getLogger(_SDK_LOGGER).removeFilter(self._silencer)

    # -- the loop's side: two observers ---------------------------------------------------
    def opened(self, call: GenerateCall) -> None:
        request = call.origin.call_request if call.origin is not None else None
        if request is not None:  # the headers are read in the export thread
            self._origins[call] = (request.path, request.headers.raw)

    def closed(self, call: GenerateCall) -> None:
        origin = self._origins.pop(call, _NO_ORIGIN)
        worker, queue = self.worker(), self._queue
        for run in call.runs:
            rec, item = run.rec, run.item
            out = cached = 0
            reasons: list[str] = []
            for s in run.samples:
                out += len(s.ids)
                cached += s.cached_tokens
                if isinstance(s.finish, dict):
                    reasons.append(str(s.finish.get("type")))
            first = run.samples[0] if run.samples else None
            if len(queue) == queue.maxlen:
                self.pushed_out += 1  # the append below pushes the oldest out
            queue.append(
                _Ended(
                    rec.id, rec.client_rid or (first.rid if first else None), rec.created_ns,
                    rec.raw_trace, rec.state, rec.cause, rec.detail, origin,
                    item.sampling if item is not None else None,
                    item is not None and item.options.embed is not None, first.prompt_tokens if first else None, out,
                    cached, reasons, worker,
                )
            )  # fmt: skip
        if len(queue) >= self.config.batch_size and not self.failing and not self._wake.is_set():
            self._wake.set()

    # -- the export thread ----------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.config.interval)
            self._wake.clear()
            if not self._round(drain=False):  # a failing collector: one try per interval
                self._stopped.wait(self.config.interval)
        self._round(drain=True)

    def _round(self, drain: bool) -> bool:
        try:
            return self._export(drain)
        except Exception:  # a bug here must not end export for good: logged, next round
            log.exception("OTLP span export failed")
            return False

    def _export(self, drain: bool) -> bool:
        """Full batches, then the rest (``drain``: all of it; else one batch); False at a
        failed batch, which ends the round. While the collector fails, a batch is one span
        (a probe): the rest waits in the queue, unbuilt, or is pushed out by newer ones."""
        from opentelemetry.sdk.trace.export import SpanExportResult

        queue, size, first = self._queue, self.config.batch_size, True
        while queue and (drain or first or len(queue) >= size):
            first = False
            n = 1 if self.failing else min(len(queue), size)
            spans = [s for s in (self._span(queue.popleft()) for _ in range(n)) if s is not None]
            if not spans:
                continue
            if self._sdk.export(spans) is not SpanExportResult.SUCCESS:
                self.failed_spans += len(spans) + (len(queue) if drain else 0)
                if not self._closed:
                    self._failed("the collector refused the batch or did not answer")
                return False
            self.exported += len(spans)
            if self.failing:
                self.failing = False
                log.info("OTLP trace export to %s works again", self.config.endpoint)
        return True

    def _failed(self, reason: str) -> None:
        """Export failed: one warning until it works again (then one info line)."""
        if not self.failing:
            self.failing = True
            log.warning(
                "OTLP trace export to %s failed (%s); request spans are dropped until it "
                "works again (not logged again)",
                self.config.endpoint,
                reason,
            )

    def _parent(self, e: _Ended) -> SpanContext | None:
        """The caller's span (W3C Trace Context), or None: a new trace."""
        from opentelemetry import trace

        parents = [v for n, v in e.origin[1] if n == b"traceparent"]
        if len(parents) != 1:  # none, or several: no valid parent (W3C Trace Context 3.2)
            return None
        carrier = {"traceparent": parents[0].decode("latin-1")}
        states = [v.decode("latin-1") for n, v in e.origin[1] if n == b"tracestate"]
        if states:
            carrier["tracestate"] = ",".join(states)  # several: one list (3.3)
        parent = trace.get_current_span(self._propagator.extract(carrier)).get_span_context()
        return parent if parent.is_valid else None

    def _span(self, e: _Ended) -> ReadableSpan | None:
        from opentelemetry.sdk.trace import Event as SpanEvent
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        parent = self._parent(e)
        if parent is not None and not parent.trace_flags.sampled:
            self.unsampled += 1  # the caller decided: parent-based sampling
            return None
        context = SpanContext(
            parent.trace_id if parent is not None else self._ids.generate_trace_id(),
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
            trace_state=parent.trace_state if parent is not None else None,
        )
        off, trace = self.offset_ns, e.trace
        events = [SpanEvent(dst.value, _event_attributes(ev, detail, e), t_ns + off)
                  for t_ns, _, dst, ev, detail in trace]  # fmt: skip
        end_ns = trace[-1][0] if trace else e.created_ns
        failed = e.state is State.ERROR
        cause = e.cause.value if e.cause is not None else "internal"
        path = e.origin[0]
        operation = "embeddings" if e.embed else _OPERATIONS.get(path, "text_completion")
        status = Status(StatusCode.ERROR, f"{cause}: {e.message}" if e.message else cause)
        return ReadableSpan(
            name=f"{operation} {self.config.model}" if self.config.model else operation,
            context=context,
            parent=parent,
            resource=self._resource,
            attributes=self._attributes(e, operation, cause if failed else None),
            events=events,
            kind=SpanKind.SERVER,
            status=status if failed else Status(StatusCode.UNSET),
            start_time=e.created_ns + off,
            end_time=end_ns + off,
            instrumentation_scope=self._scope,
        )

    def _attributes(self, e: _Ended, operation: str, cause: str | None) -> dict[str, Any]:
        a: dict[str, Any] = {"gen_ai.operation.name": operation}
        if self.config.model:
            a["gen_ai.request.model"] = self.config.model
        if e.sampling is not None:
            _sampling_attributes(a, e.sampling, e.embed)
        if e.prompt_tokens is not None:
            a["gen_ai.usage.input_tokens"] = e.prompt_tokens
        a["gen_ai.usage.output_tokens"] = e.output_tokens
        if e.finish_reasons:
            a["gen_ai.response.finish_reasons"] = e.finish_reasons
        if e.origin[0]:
            a["url.path"] = e.origin[0]
        a["lifecycle.id"] = e.rec_id
        if e.rid is not None:
            a["lifecycle.rid"] = e.rid
        if e.worker is not None and any(t[3] is Event.DISPATCH for t in e.trace):
            a["lifecycle.worker"] = e.worker
        a["lifecycle.cached_tokens"] = e.cached_tokens
        a["lifecycle.state"] = e.state.value
        if cause is not None:
            a["lifecycle.cause"] = cause
            a["error.type"] = cause
        return a


def _sampling_attributes(a: dict[str, Any], sampling: SamplingRequest, embed: bool) -> None:
    max_tokens, sp = sampling.max_new_tokens, sampling.params
    if max_tokens is not None and not embed:
        a["gen_ai.request.max_tokens"] = max_tokens
    if not embed:
        a["gen_ai.request.temperature"] = sp.temperature
        a["gen_ai.request.top_p"] = sp.top_p
        if sp.top_k > 0:
            a["gen_ai.request.top_k"] = sp.top_k
    if sp.n != 1:
        a["gen_ai.request.choice.count"] = sp.n


def _event_attributes(event: Event, detail: Any, e: _Ended) -> dict[str, Any]:
    """The edge's event and detail (the state it entered names the span event; the one it
    left is the previous event's, or ``received``)."""
    a: dict[str, Any] = {"lifecycle.event": event.value}
    if detail is not None:
        a["lifecycle.detail"] = detail_json(detail)
    if event is Event.FAIL and e.message:
        a["lifecycle.message"] = e.message
    return a


class _Silencer(logging.Filter):
    """Drops the SDK exporter's log lines from our export thread (one per failed batch and
    per retry) and turns the first of a failing run into our one warning."""

    def __init__(self, exporter: OtlpExporter) -> None:
        super().__init__()
        self.exporter = exporter

    def filter(self, record: logging.LogRecord) -> bool:
        thread = self.exporter._thread
        if record.thread != thread.ident:
            return True  # another exporter's line: its own filter decides
        if record.levelno >= logging.WARNING and not self.exporter._closed:
            self.exporter._failed(record.getMessage())
        return False
