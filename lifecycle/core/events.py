"""A frontend's one feed of request events (docs/architecture.md, "Observability").

Everything that watches requests subscribes here, once, with the methods it has of these
four (each optional):

- ``opened(call)``: a new call, in the task that made it (the access log and the
  OpenTelemetry export read the HTTP request's context there);
- ``transition(rec, entry)``: a record took an edge of the state table (the tracer);
- ``released(rec)``: the worker let go of a record's hold (the tracer's release times);
- ``closed(call)``: every record of the call is terminal (metrics, the export).

The record-level events come from the state machine's one process-wide observer slot
(``lifecycle.core.fsm.set_observer``), which the feed takes while something subscribes
to them and gives back on ``close``. A subscriber's bug never stops a request: the
state machine isolates ``transition`` and ``released`` (``fsm._tell``), the feed
``opened`` and ``closed``. Nothing here does I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from lifecycle.core import fsm

__all__ = ["Events"]

log = logging.getLogger("lifecycle.core.events")

KINDS = ("opened", "transition", "released", "closed")


class Events:
    def __init__(self) -> None:
        self._hooks: dict[str, list[Callable[..., None]]] = {k: [] for k in KINDS}
        self._installed = False
        self._previous: Any = None

    def subscribe(self, observer: object) -> None:
        """Register each of the four methods ``observer`` has."""
        for kind in KINDS:
            hook = getattr(observer, kind, None)
            if callable(hook):
                self._hooks[kind].append(hook)
        wants_records = self._hooks["transition"] or self._hooks["released"]
        if wants_records and not self._installed:
            self._previous, self._installed = fsm.set_observer(self), True

    def close(self) -> None:
        """Give the state machine's observer slot back (a second Engine in a process that
        shuts down first leaves the first one's feed working)."""
        if self._installed and fsm._observer is self:
            fsm.set_observer(self._previous)
        self._installed = False

    # -- the events ------------------------------------------------------------------------
    def opened(self, call: Any) -> None:
        self._each("opened", call)

    def closed(self, call: Any) -> None:
        self._each("closed", call)

    def transition(self, rec: Any, entry: Any) -> None:  # every edge: no more than a loop
        for hook in self._hooks["transition"]:
            hook(rec, entry)

    def released(self, rec: Any) -> None:
        for hook in self._hooks["released"]:
            hook(rec)

    def _each(self, kind: str, call: Any) -> None:
        for hook in self._hooks[kind]:
            try:
                hook(call)
            except Exception:  # a subscriber's bug must not refuse or leak the request
                log.exception("%s subscriber failed", kind)
