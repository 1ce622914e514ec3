"""A frontend's one feed of request events (docs/architecture.md, "Observability").

Everything that watches requests subscribes here, once, with the methods it has of these
four (each optional):

- ``opened(call)``: a new call, in the task that made it (the access log and the
  OpenTelemetry export read the HTTP request's context there);
- ``transition(rec, entry)``: a record took an edge of the state table (the tracer);
- ``released(rec)``: the worker let go of a record's hold (the tracer's release times);
- ``closed(call)``: every record of the call is terminal (metrics, the export).

The record-level events come from the records themselves: while something subscribes
to them, the frontend's registry gives each record it files this feed as its observer
(``RequestRecord.observer``), so that with several frontends in one process (one per
model) each feed hears of its own records only; ``close`` stops that. (A feed made
without a registry takes the state machine's one process-wide observer slot instead,
``fsm.set_observer``, and gives it back on ``close``.) A subscriber's bug never stops a
request: the state machine isolates ``transition`` and ``released`` (``fsm._tell``), the
feed ``opened`` and ``closed``. Nothing here does I/O.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lifecycle.core import fsm

if TYPE_CHECKING:
    from lifecycle.core.registry import Registry

__all__ = ["Events"]

log = logging.getLogger("lifecycle.core.events")

KINDS = ("opened", "transition", "released", "closed")


class Events:
    def __init__(self, registry: Registry | None = None) -> None:
        """``registry``: the frontend's, whose records this feed hears of."""
        self._hooks: dict[str, list[Callable[..., None]]] = {k: [] for k in KINDS}
        self._registry = registry
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
            if self._registry is not None:
                self._registry.observer = self
            else:
                self._previous = fsm.set_observer(self)
            self._installed = True

    def close(self) -> None:
        """Stop the record-level events: records filed from now on have no observer, and
        those filed before tell subscribers nothing more (a feed without a registry gives
        the state machine's slot back: a second Engine in a process that shuts down
        first leaves the first one's feed working)."""
        if self._installed:
            if self._registry is not None:
                if self._registry.observer is self:
                    self._registry.observer = None
            elif fsm._observer is self:
                fsm.set_observer(self._previous)
        self._hooks["transition"].clear()
        self._hooks["released"].clear()
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
