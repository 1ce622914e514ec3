"""What the worker holds for one submitted prompt, and where its samples' output goes.

A ``Submission`` is the one record of that fact (``WorkerHold``, moved only along
``states.HOLD_EDGES``). The dispatcher (``lifecycle.link.worker_client``) moves it; the
request record, the registry's tombstones, the abort lane and the egress ask it. Each
sample's output goes to a ``Sink``; a sample that ends without a finish reason of the
worker's ends with a ``WorkerFailure``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from lifecycle.core.states import HOLD_EDGES, Cause, WorkerHold
from wire import ErrorCode, Finish, SubmitEntry

__all__ = ["Sink", "Submission", "WorkerFailure", "finish_reason"]


class Sink(Protocol):
    """Where one sample's output goes (``lifecycle.core.buffers.OutputBuffer`` fits)."""

    def append(self, ids: list[int], extra: dict[str, Any] | None = None) -> object: ...

    def finish(self, reason: Any) -> object: ...


_REQ_ERROR_CODES = frozenset(ErrorCode)  # each a Cause's value too (tests/test_wire.py)


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """Terminal reason when the worker refused a request (a REQ-ERROR, ``of_req_error``),
    the connection was lost, or the frontend ended the sample with an error."""

    cause: Cause
    message: str

    @classmethod
    def of_req_error(cls, code: str, message: str) -> WorkerFailure:
        """A REQ-ERROR's failure: its code is the cause of the same name; a code this
        frontend does not know is internal."""
        cause = Cause(code) if code in _REQ_ERROR_CODES else Cause.INTERNAL
        return cls(cause, message)


def finish_reason(finish: list[Any]) -> dict[str, Any]:
    """A wire ``finish`` -> SGLang's ``meta_info.finish_reason`` object (a stop_regex
    match keeps the pattern's index as ``regex`` until ``OutputOptions`` names it)."""
    kind, value = finish[0], finish[1]
    if kind == Finish.STOP:
        if len(finish) == 3:
            return {"type": Finish.STOP, "matched": value, "regex": finish[2]}
        return {"type": Finish.STOP, "matched": value}
    if kind == Finish.LENGTH:
        return {"type": Finish.LENGTH, "length": value}
    if kind == Finish.EMBED:  # an embed request's end: its vector came with it
        return {"type": Finish.EMBED, "dimensions": value}
    return {"type": Finish.ABORT, "message": str(value)}


_HOLD_MOVES = {(e.src, e.event): e.dst for e in HOLD_EDGES}


class Submission:
    """One submitted prompt with its ``n`` samples: what the worker holds for it.

    The samples' wire rids are ``rid .. rid + n - 1``; ``sinks[i]`` is None once sample
    ``i`` ended or its output is to be dropped. ``on_dispatch`` runs when the prompt is
    handed to the worker, ``on_release`` when a hold the worker had ends.
    """

    __slots__ = (
        "rid", "n", "entry", "sinks", "hold", "open", "on_dispatch", "on_release",
        "abort_message", "entry_bytes",
    )  # fmt: skip

    def __init__(
        self,
        rid: int,
        sinks: list[Sink],
        entry: SubmitEntry | None,
        on_dispatch: Callable[[], None] | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.rid = rid
        self.n = len(sinks)
        self.entry = entry
        self.sinks: list[Sink | None] = list(sinks)
        self.hold = WorkerHold.NONE
        self.open = self.n  # samples the worker has not ended yet
        self.on_dispatch = on_dispatch
        self.on_release = on_release
        # Why the frontend aborted it: the worker's abort entry says only that it ended,
        # so this is the one message its samples report.
        self.abort_message: str | None = None
        self.entry_bytes = 0  # the entry's CBOR size (set by the dispatcher)

    def move(self, event: str) -> None:
        dst = _HOLD_MOVES.get((self.hold, event))
        if dst is None:
            raise RuntimeError(f"submission {self.rid}: no {event!r} from {self.hold.value!r}")
        src, self.hold = self.hold, dst
        callback = self.on_dispatch if event == "dispatch" else None
        if src is WorkerHold.RUNNING:  # only a hold the worker had ends in a release
            callback = self.on_release
        if callback is not None:
            callback()

    def end_all(self, reason: Any) -> None:
        """Finish every sample that has not ended yet with ``reason``."""
        for i, sink in enumerate(self.sinks):
            if sink is not None:
                self.sinks[i] = None
                sink.finish(reason)
