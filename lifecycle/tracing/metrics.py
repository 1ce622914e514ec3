"""Prometheus metrics, every name prefixed ``lifecycle_``; docs/metrics.md. ``GET /metrics``
serves ``render()`` (``lifecycle.api.metrics``); the Engine keeps the same metrics
without HTTP.

Nothing here runs per token. Counters and histograms move once per HTTP request (the
route wrapper calls ``observe_http``) and once per generation record when its call is
closed (``closed``, from the frontend's event feed: the one place every request
reaches its terminal state). Gauges are read at scrape time from the registry, the
admission queue, the supervisor and one STATS round trip to the worker, which also
carries the worker's step histograms (``wire/stats.py``: counted once per step there).

The registry is our own ``CollectorRegistry``, never the process-global one, so several
apps (tests) in one process do not collide.

Every series of a model carries ``model_name`` (its served model id: SGLang's and vLLM's
label), with one model too; the series of the process itself (``lifecycle_process_*``,
the unknown body fields, the tracer's health) carry none. A server with several models
answers one exposition (``shared_metrics.join_models``): each family once, every model's
samples under it, the process's series once.
"""

from __future__ import annotations

import logging
import math
import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

import anyio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from lifecycle.core import fields
from lifecycle.core.fsm import TraceEntry
from lifecycle.core.states import Cause, Event, State
from lifecycle.core.version import __version__
from wire import read_histogram

if TYPE_CHECKING:
    from lifecycle.core.call import GenerateCall
    from lifecycle.core.frontend import Frontend

__all__ = ["MODEL_LABEL", "PREFIX", "Metrics", "TracerHealth", "record_timings"]


class TracerHealth(Protocol):
    """What /metrics reads of the tracer (``lifecycle.tracing.tracer.Tracer``)."""

    @property
    def errors(self) -> int: ...

    def log_status(self) -> dict[str, Any] | None: ...


log = logging.getLogger("lifecycle.tracing.metrics")

PREFIX = "lifecycle"
MODEL_LABEL = "model_name"  # the served model id on each of a model's series
STATS_TIMEOUT = 1.0

# Seconds. Fine at the low end (a 135M model on a GPU answers in milliseconds), up to the
# minutes a long generation on a CPU takes.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
    0.075, 0.1, 0.2, 0.5, 1.0, 2.5,
)  # fmt: skip
# Tokens: powers of two from one token to a 128K context.
_TOKEN_BUCKETS = tuple(float(2**i) for i in range(18))

# A finished sample's reason: the worker's finish type (stop, length, abort, embed) when
# its request ended done; the error cause when it ended in error, "abort" for a client's
# abort (its reply says finish_reason abort).
_ABORT = "abort"


def record_timings(trace: list[TraceEntry], created_ns: int) -> dict[str, float]:
    """Queue time, time to first token and end-to-end latency (seconds) from a record's trace.

    queue: from admission (QUEUED) to dispatch (RUNNING); ttft: from arrival to the first
    token reaching the frontend; e2e: from arrival to the terminal state.
    """
    t: dict[Event, int] = {}
    end_ns = created_ns
    for entry in trace:
        t.setdefault(entry.event, entry.t_ns)
        end_ns = entry.t_ns
    out: dict[str, float] = {"e2e": (end_ns - created_ns) / 1e9}
    if Event.ADMIT in t and Event.DISPATCH in t:
        out["queue"] = (t[Event.DISPATCH] - t[Event.ADMIT]) / 1e9
    if Event.FIRST_TOKEN in t:
        out["ttft"] = (t[Event.FIRST_TOKEN] - created_ns) / 1e9
        out["decode"] = (end_ns - t[Event.FIRST_TOKEN]) / 1e9
        if Event.DISPATCH in t:
            out["prefill"] = (t[Event.FIRST_TOKEN] - t[Event.DISPATCH]) / 1e9
    return out


def finish_label(state: State, cause: Cause | None, finish: Any) -> str:
    """``lifecycle_finish_reasons_total``'s ``reason`` for one sample: its finish type
    when its request ended done; its request's cause when that ended in error, the
    cause ``aborted`` as ``abort`` (what the client's finish_reason says)."""
    if state is State.DONE:
        kind = finish.get("type") if isinstance(finish, dict) else None
        return kind if isinstance(kind, str) else Cause.INTERNAL.value
    c = _cause(cause)
    return _ABORT if c == Cause.ABORTED.value else c


class Metrics:
    def __init__(self, frontend: Frontend, model: str = "") -> None:
        """``model``: the served model id: every series' ``model_name``, and the
        ``model`` of ``lifecycle_build_info``."""
        # No `_created` series beside each counter and histogram (prometheus_client's
        # switch: it is process-wide, and this process serves one exposition).
        disable_created_metrics()
        self.fe = frontend
        self.model = model
        self.tracer: TracerHealth | None = None  # watch_tracer: its health is scraped too
        self.registry = CollectorRegistry(auto_describe=True)
        self._loads: list[dict[str, Any]] = []  # each worker's STATS, by pool index
        r, p = self.registry, PREFIX
        self.http_requests = Counter(
            f"{p}_http_requests", "HTTP requests by route and status.",
            ["endpoint", "method", "status"], registry=r,
        )  # fmt: skip
        # Requests by outcome are the registry's books (Registry.finished / failed) and the
        # tokens generated the frontend's tally (output_tokens), read at scrape: counted once.
        self.prompt_tokens = Counter(
            f"{p}_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.cache_hit_tokens = Counter(
            f"{p}_cache_hit_tokens", "Prompt tokens served from the prefix cache.", registry=r
        )
        self.ttft = _latency(r, "time_to_first_token_seconds", "Arrival to first token.")
        self.e2e = _latency(r, "e2e_request_latency_seconds", "Arrival to terminal state.")
        self.queue = _latency(r, "queue_time_seconds", "Admission to dispatch.")
        self.itl = Histogram(
            f"{p}_inter_token_latency_seconds",
            "Mean time between output tokens, one observation per sample.",
            registry=r, buckets=_ITL_BUCKETS,
        )  # fmt: skip
        self.prefill = _latency(r, "request_prefill_time_seconds",
                                "Dispatch to the first token (the prompt's computation).")  # fmt: skip
        self.decode = _latency(r, "request_decode_time_seconds",
                               "First token to the terminal state.")  # fmt: skip
        self.finish_reasons = Counter(
            f"{p}_finish_reasons", "Samples that ended, by finish reason (stop, length, "
            "abort, embed) or, for a request that ended in error, its cause.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.prompt_len = Histogram(
            f"{p}_request_prompt_tokens", "Prompt length of each ended request, in tokens.",
            registry=r, buckets=_TOKEN_BUCKETS,
        )  # fmt: skip
        self.output_len = Histogram(
            f"{p}_request_generation_tokens", "Output length of each ended sample, in tokens.",
            registry=r, buckets=_TOKEN_BUCKETS,
        )  # fmt: skip
        self.retractions = Counter(
            f"{p}_retractions", "Times the worker preempted a sequence to free KV blocks "
            "(recomputed later), summed over ended samples.", registry=r,
        )  # fmt: skip
        self.registry.register(_LiveCollector(self))
        # The process's own series, without model_name (once however many models):
        # lifecycle_process_resident_memory_bytes, CPU seconds, open file descriptors
        # (Linux /proc; nothing elsewhere), the unknown body fields, the tracer's health.
        self.process = CollectorRegistry(auto_describe=True)
        ProcessCollector(namespace=p, registry=self.process)
        self.process.register(_ProcessCollector(self))
        self._labelled = CollectorRegistry(auto_describe=False)
        self._labelled.register(_Labelled(self.registry, model))
        frontend.events.subscribe(self)

    def watch_tracer(self, tracer: TracerHealth) -> None:
        """Report the tracer's health: its failures and whether ``--trace-log`` writes."""
        self.tracer = tracer

    # -- hooks ----------------------------------------------------------------------------
    def observe_http(self, endpoint: str, method: str, status: int) -> None:
        self.http_requests.labels(endpoint, method, str(status)).inc()

    def closed(self, call: GenerateCall) -> None:
        """One observation per record of a closed call (each has reached its terminal state)."""
        for run in call.runs:
            rec = run.rec
            timings = record_timings(rec.trace, rec.created_ns)
            self.e2e.observe(timings["e2e"])
            if "queue" in timings:
                self.queue.observe(timings["queue"])
            if "ttft" in timings:
                self.ttft.observe(timings["ttft"])
                self.decode.observe(timings["decode"])
            if "prefill" in timings:
                self.prefill.observe(timings["prefill"])
            if run.samples:
                self.prompt_tokens.inc(run.samples[0].prompt_tokens)
                self.prompt_len.observe(run.samples[0].prompt_tokens)
            else:  # refused or cut before it had samples: one count, its cause
                self.finish_reasons.labels(finish_label(rec.state, rec.cause, None)).inc()
            for sample in run.samples:
                n = len(sample.ids)
                self.cache_hit_tokens.inc(sample.cached_tokens)
                self.output_len.observe(n)
                self.finish_reasons.labels(finish_label(rec.state, rec.cause, sample.finish)).inc()
                if sample.num_retractions:
                    self.retractions.inc(sample.num_retractions)
                if n > 1 and "decode" in timings:
                    self.itl.observe(timings["decode"] / (n - 1))

    # -- scrape ---------------------------------------------------------------------------
    async def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type, after one STATS call to each ready
        worker (concurrently)."""
        members = self.fe.supervisor.members
        loads: list[dict[str, Any]] = [{} for _ in members]

        async def one(i: int, client: Any) -> None:
            try:
                loads[i] = await client.stats(timeout=STATS_TIMEOUT)
            except (TimeoutError, ConnectionError) as exc:
                log.debug("metrics: worker %d stats unavailable: %s", i, exc)

        async with anyio.create_task_group() as tg:
            for i, sup in enumerate(members):
                if sup.client is not None:
                    tg.start_soon(one, i, sup.client)
        self._loads = loads
        return self.text(), CONTENT_TYPE_LATEST

    def text(self) -> bytes:
        """The exposition as it stands, the workers' gauges from the last STATS: the
        model's series, each labelled with its ``model_name``, then the process's."""
        return generate_latest(self._labelled) + generate_latest(self.process)


class _Labelled(Collector):
    """``registry``'s families, each sample labelled ``model_name``: ``model``."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.registry, self.model = registry, model

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [
                s._replace(labels={**s.labels, MODEL_LABEL: self.model}) for s in family.samples
            ]
            yield out


def _latency(registry: CollectorRegistry, name: str, help_text: str) -> Histogram:
    return Histogram(f"{PREFIX}_{name}", help_text, registry=registry, buckets=_LATENCY_BUCKETS)


def _cause(cause: Cause | None) -> str:
    return cause.value if cause is not None else Cause.INTERNAL.value


class _LiveCollector(Collector):
    """Gauges read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked: the families below are created fresh on every collect

    def collect(self) -> Iterator[Metric]:
        fe, p = self.m.fe, PREFIX
        info = GaugeMetricFamily(
            f"{p}_build_info", "Always 1: this server's version, served model id and Python.",
            labels=["version", "model", "python"],
        )  # fmt: skip
        info.add_metric([__version__, self.m.model, platform.python_version()], 1)
        yield info
        states = GaugeMetricFamily(
            f"{p}_requests_in_state", "Live requests in each lifecycle state.", labels=["state"]
        )
        for state, count in fe.registry.counts_by_state().items():
            states.add_metric([state], count)
        yield states
        yield from _outcomes(fe)
        yield _gauge("tombstones", "Ended requests the worker has not released yet.",
                     fe.registry.tombstones)  # fmt: skip
        yield _gauge("admission_queue_depth", "Requests admitted and not yet dispatched.",
                     fe.admission.depth)  # fmt: skip
        yield _gauge("admission_queue_capacity", "Admission bound (beyond it: 503).",
                     fe.admission.capacity)  # fmt: skip
        # One series per worker (label "worker": its index in the pool, "0" alone).
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}

        def add(
            name: str, help_text: str, worker: str, value: float, counter: bool = False
        ) -> None:
            if name not in families:
                cls = CounterMetricFamily if counter else GaugeMetricFamily
                families[name] = cls(f"{p}_{name}", help_text, labels=["worker"])
            families[name].add_metric([worker], value)

        histograms: dict[str, HistogramMetricFamily] = {}
        worker_info = GaugeMetricFamily(
            f"{p}_worker_info", "Always 1: what the worker's HELLO says it runs.",
            labels=["worker", "name", "arch", "device", "dtype", "weights", "decode_graphs"],
        )  # fmt: skip

        loads = self.m._loads
        for i, sup in enumerate(fe.supervisor.members):
            w = str(i)
            # A counter (it only grows): increase() and rate() apply; promtool wants _total.
            add("worker_restarts", "Worker restarts since start-up.", w, sup.restarts, True)
            add("worker_ready", "1 when the worker is ready to serve.", w, int(sup.ready))
            client = sup.client
            if client is not None:
                add("dispatch_queue_depth", "Requests waiting for worker credits.", w,
                    client.queued)  # fmt: skip
                add("worker_in_flight", "Requests the worker holds.", w, client.in_flight)
                mc, cap = client.model, client.capacity
                worker_info.add_metric(
                    [w, *(str(mc.get(k, "")) for k in ("name", "arch", "device", "dtype")),
                     str(cap.get("weights", "")), str(cap.get("decode_graphs", ""))], 1,
                )  # fmt: skip
            load = loads[i] if i < len(loads) else {}
            # (STATS key, gauge name): a gauge may not end in _total (promtool check metrics).
            for key, name, help_text in (
                ("running", "running", "Sequences the worker is running."),
                ("waiting", "waiting", "Sequences waiting in the worker's scheduler."),
                ("kv_blocks_total", "kv_blocks_capacity", "KV cache blocks in all."),
                ("kv_blocks_free", "kv_blocks_free", "KV cache blocks free."),
                ("kv_blocks_cached", "kv_blocks_cached",
                 "Free KV blocks holding a reusable prefix."),
            ):  # fmt: skip
                if isinstance(load.get(key), int):
                    add(f"worker_{name}", help_text, w, load[key])
            # Speculative decoding (--speculative): counters since the worker started.
            for key, name, help_text in (
                ("spec_num_proposed_drafts", "spec_draft_tokens",
                 "Tokens speculative decoding proposed."),
                ("spec_num_correct_drafts", "spec_accepted_tokens",
                 "Proposed tokens that were accepted (each one a model step saved)."),
                ("spec_verify_ct", "spec_verify_steps", "Proposals checked, one a request and step."),
            ):  # fmt: skip
                if isinstance(load.get(key), int):
                    add(name, help_text, w, load[key], True)  # exposed as NAME_total
            total, free = load.get("kv_blocks_total"), load.get("kv_blocks_free")
            if isinstance(total, int) and isinstance(free, int):
                add("worker_kv_blocks_used", "KV cache blocks in use.", w, total - free)
                if total > 0:
                    add("worker_kv_usage_ratio", "KV cache blocks in use over all of them "
                        "(0 to 1; free blocks holding a cached prefix are not in use).", w,
                        (total - free) / total)  # fmt: skip
            memory = load.get("memory")
            for key, name, help_text in (
                ("rss_bytes", "memory_rss_bytes", "The worker process's resident memory."),
                ("device_allocated_bytes", "gpu_memory_allocated_bytes",
                 "CUDA memory the worker's tensors hold."),
                ("device_reserved_bytes", "gpu_memory_reserved_bytes",
                 "CUDA memory the worker's allocator reserved from the driver."),
                ("device_total_bytes", "gpu_memory_total_bytes", "The worker's card's memory."),
            ):  # fmt: skip
                if isinstance(memory, dict) and isinstance(memory.get(key), int):
                    add(f"worker_{name}", help_text, w, memory[key])
            for key, name, help_text in (
                ("step_seconds", "step_seconds",
                 "Each worker step's time, scheduling to its STEP entries."),
                ("step_batch", "batch_size",
                 "Sequences in each worker step (decodes and prompt chunks)."),
                ("step_tokens", "step_tokens", "Tokens run through the model in each step."),
            ):  # fmt: skip
                read = read_histogram(load.get(key))
                if read is None:
                    continue
                if name not in histograms:
                    histograms[name] = HistogramMetricFamily(
                        f"{p}_worker_{name}", help_text, labels=["worker"]
                    )
                buckets, total_sum = read
                histograms[name].add_metric(
                    [w], [(_le(b), c) for b, c in buckets], sum_value=total_sum
                )
        yield from families.values()
        yield from histograms.values()
        if worker_info.samples:
            yield worker_info


class _ProcessCollector(Collector):
    """The process's own families read at scrape time (no model_name): the unknown body
    fields (one policy for the process) and the tracer's health (one tracer for every
    model)."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics

    def describe(self) -> list[Metric]:
        return []  # unchecked: the families below are created fresh on every collect

    def collect(self) -> Iterator[Metric]:
        unknown = CounterMetricFamily(
            f"{PREFIX}_unknown_fields",
            "Requests that sent a body field this server does not know (ignored; "
            "--strict-fields refuses them), by where and field: the first 64 names, "
            "then <where>.(other).",
            labels=["field"],
        )
        for name, count in sorted(fields.policy().snapshot().items()):
            unknown.add_metric([name], count)
        yield unknown
        if self.m.tracer is not None:
            yield from _tracer_health(self.m.tracer)


def _le(bound: float) -> str:
    """A bucket bound as Prometheus writes it (``+Inf``, ``0.005``, ``16.0``)."""
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def _outcomes(fe: Frontend) -> Iterator[Metric]:
    """The registry's books of ended requests and the frontend's generated tokens, as
    counters."""
    p = PREFIX
    requests = CounterMetricFamily(
        f"{p}_requests", "Generation requests that reached a terminal state, by outcome "
        "(done, or the error cause).", labels=["outcome"],
    )  # fmt: skip
    errors = CounterMetricFamily(
        f"{p}_request_errors", "Generation requests that ended in error, by cause.",
        labels=["cause"],
    )  # fmt: skip
    if fe.registry.finished:
        requests.add_metric(["done"], fe.registry.finished)
    for cause, count in sorted(fe.registry.failed.items()):
        requests.add_metric([cause], count)
        errors.add_metric([cause], count)
    yield requests
    yield errors
    yield CounterMetricFamily(
        f"{p}_generation_tokens", "Tokens generated (all samples).", fe.output_tokens
    )


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help_text, value=value)


def _tracer_health(tracer: TracerHealth) -> Iterator[Metric]:
    yield CounterMetricFamily(f"{PREFIX}_tracer_errors", "Tracer failures (a bug, logged "
                              "once); the requests went on.", value=tracer.errors)  # fmt: skip
    status = tracer.log_status()
    if status is None:  # no --trace-log
        return
    yield _gauge("trace_log_ok", "1 while --trace-log writes; 0 once it failed and was "
                 "turned off (the server log says why).", int(status["ok"]))  # fmt: skip
    yield CounterMetricFamily(f"{PREFIX}_trace_log_unlogged", "Finished requests the trace "
                              "log did not take after it failed.", value=status["unlogged"])  # fmt: skip
