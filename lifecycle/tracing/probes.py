"""What a trace says of a request beyond its record: the tracer's probes and recorders.

A probe is asked when a request is listed or looked up live (``/debug/requests``, the
feed's snapshot) and once at its terminal edge; its answer goes into the trace beside the
record's edges (``FinishedTrace``'s ``extra``). ``worker_probe`` reports the tokens
produced so far and the worker that holds or held the request; ``call_probe``, the
server's, adds what the request's call knows. A recorder keeps what a finished request
needs to be replayed (``lifecycle.tracing.replay``). The ``Tracer``
(``lifecycle/tracing/tracer.py``) asks them for each model it watches; nothing here keeps
state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from lifecycle.core.fsm import RequestRecord
from lifecycle.core.outputs import SPEC_KEYS
from lifecycle.core.states import Event, State

if TYPE_CHECKING:
    from lifecycle.core.call import GenerateCall

__all__ = [
    "Probe",
    "Recorder",
    "call_probe",
    "default_probe",
    "worker_probe",
]

_DONE, _ERROR, _DISPATCH = State.DONE, State.ERROR, Event.DISPATCH

# What the tracer asks about a request beyond its record: {"tokens": int, "worker": str}.
Probe = Callable[[RequestRecord], dict[str, Any]]
# What a finished request's trace keeps to replay it (``lifecycle.tracing.replay``): its
# prompt and output ids, sampling parameters and model; None when there is nothing to keep.
Recorder = Callable[[RequestRecord], dict[str, Any] | None]


def worker_probe(worker: Callable[[], str | None]) -> Probe:
    """A probe reporting the record's token counter and ``worker()`` as the worker: for a
    live request while the worker holds it, for a finished one if it was ever dispatched."""

    def probe(rec: RequestRecord) -> dict[str, Any]:
        return {"tokens": rec.tokens, "worker": worker() if _served(rec) else None}

    return probe


def _served(rec: RequestRecord) -> bool:
    """Whether a worker has (had) the request: held now, or dispatched once."""
    # DONE implies it was dispatched: only an error needs the (short) trace scanned.
    state = rec.state
    return (
        rec.held_by_worker
        or state is _DONE
        or (state is _ERROR and any(e[3] is _DISPATCH for e in rec._trace))
    )


default_probe: Probe = worker_probe(lambda: "worker")


class CallIndex(Protocol):
    """The live calls by record (``lifecycle.core.live_calls.LiveCalls``)."""

    def of(self, rec_id: int) -> GenerateCall | None: ...


# The worker a call's client belongs to: (its index in the pool, its name), or None.
WorkerOf = Callable[[Any], "tuple[int, str] | None"]


def call_probe(
    calls: CallIndex, worker_of: WorkerOf, fallback: Callable[[], str | None], prompts: bool
) -> Probe:
    """``worker_probe``'s answer plus what the request's call knows: the client's address,
    prompt and cached tokens, each sample's finish reason, the sampling parameters, the
    worker that served it (its index under ``--dp``), a rejection's HTTP status, how long
    it waited for its model to load (``model_wait``, seconds) and, with ``prompts``
    (``--trace-prompts``), the prompt's text. Asked when a request is listed and once at
    its terminal edge, while its call still owns it."""
    base = worker_probe(fallback)

    def probe(rec: RequestRecord) -> dict[str, Any]:
        out = base(rec)
        call = calls.of(rec.id)
        if call is None:
            return out
        origin = call.origin
        if origin is not None:
            out["client"] = origin.client
        if call.http_status is not None:
            out["status"] = call.http_status
        if call.model_wait is not None:  # it waited for its model to load on demand
            out["model_wait"] = call.model_wait
        if out["worker"] is not None and call.client is not None:
            served = worker_of(call.client)
            if served is not None:
                out["worker_index"], out["worker"] = served
        run = next((r for r in call.runs if r.rec is rec), None)
        if run is None or run.item is None:
            return out
        out["sampling"] = run.item.sampling
        if run.samples:
            first = run.samples[0]
            out["prompt_tokens"] = first.prompt_tokens
            out["cached_tokens"] = first.cached_tokens
            specs = [s.spec for s in run.samples if s.spec]
            if specs:  # speculative decoding's record, summed over the samples
                out["speculative"] = {k: sum(s[k] for s in specs) for k in SPEC_KEYS}
            out["finish_reasons"] = [
                s.finish.get("type") if isinstance(s.finish, dict) else None for s in run.samples
            ]
            if prompts:
                text = run.item.text
                out["prompt"] = (
                    text if text is not None else call.host.codec.decode(list(first.prompt), False)
                )
        return out

    return probe
