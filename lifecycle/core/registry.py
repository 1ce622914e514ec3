"""The live requests of this process, plus tombstones the worker still holds.

Records come from ``lifecycle.core.fsm``; the registry only files them. Whether the
worker holds a request is asked of the record's submission, never copied here. It keeps
the books too, once: records received, and those that left finished or failed by cause
(``/server_info``, ``/metrics`` and ``/debug`` read them here).
"""

from __future__ import annotations

from collections.abc import Iterator

from lifecycle.core.errors import RequestError
from lifecycle.core.fsm import RequestRecord, TransitionObserver
from lifecycle.core.states import Cause, State

__all__ = ["DuplicateRid", "Registry"]


class DuplicateRid(RequestError):
    """The client's ``rid`` names a request that is still live (SGLang's message)."""

    def __init__(self, rid: str) -> None:
        super().__init__(f"Duplicate request ID detected: {rid}", 400)
        self.rid = rid


class Registry:
    """Live records by id and by client rid, and tombstones until the worker releases.

    ``remove`` on a record the worker still holds (an error after dispatch) keeps it as a
    tombstone until ``worker_released(id)``: its KV blocks are not free until then.

    ``observer``: what each record it files is told of its edges and release (its
    ``RequestRecord.observer``; the frontend's feed sets it, ``lifecycle.core.events``),
    so that with several frontends in one process each sees its own records only.
    """

    __slots__ = (
        "_live", "_by_rid", "_by_request_id", "_tombstones", "received", "finished", "failed",
        "observer",
    )  # fmt: skip

    def __init__(self) -> None:
        self._live: dict[int, RequestRecord] = {}
        self._by_rid: dict[str, RequestRecord] = {}
        # Request ids are not unique (a client may reuse its X-Request-Id): the latest wins.
        self._by_request_id: dict[str, RequestRecord] = {}
        self._tombstones: dict[int, RequestRecord] = {}
        self.received = 0  # records added; each leaves finished or failed
        self.finished = 0  # left in DONE
        self.failed: dict[str, int] = {}  # left in ERROR, by cause
        self.observer: TransitionObserver | None = None

    def add(self, rec: RequestRecord) -> None:
        rid = rec.client_rid
        if rid is not None:
            if rid in self._by_rid:
                raise DuplicateRid(rid)
            self._by_rid[rid] = rec
        self._live[rec.id] = rec
        rec.observer = self.observer  # before its first edge (validate)
        if rec.request_id is not None:
            self._by_request_id[rec.request_id] = rec
        self.received += 1

    def remove(self, rec: RequestRecord) -> None:
        """Forget a request; one that is not terminal yet is failed INTERNAL first, so
        every request that leaves the registry has reached exactly one terminal state."""
        if self._live.pop(rec.id, None) is None:
            return
        rec.fail(Cause.INTERNAL, "removed from the registry while still live")
        if rec.state is State.DONE:
            self.finished += 1
        elif rec.cause is not None:
            self.failed[rec.cause.value] = self.failed.get(rec.cause.value, 0) + 1
        if rec.client_rid is not None:
            self._by_rid.pop(rec.client_rid, None)
        if rec.request_id is not None and self._by_request_id.get(rec.request_id) is rec:
            del self._by_request_id[rec.request_id]
        if rec.held_by_worker:
            self._tombstones[rec.id] = rec

    def worker_released(self, id: int) -> RequestRecord | None:
        """The hold of request ``id`` ended (its submission is released): a tombstone is
        forgotten now."""
        rec = self._tombstones.pop(id, None) or self._live.get(id)
        if rec is not None:
            rec.worker_released()
        return rec

    def get(self, id: int) -> RequestRecord | None:
        return self._live.get(id)

    def tombstone(self, id: int) -> RequestRecord | None:
        return self._tombstones.get(id)

    @property
    def tombstones(self) -> int:
        return len(self._tombstones)

    def by_client_rid(self, rid: str) -> RequestRecord | None:
        return self._by_rid.get(rid)

    def by_request_id(self, request_id: str) -> RequestRecord | None:
        """The latest live request with this request id (``X-Request-Id`` and the like)."""
        return self._by_request_id.get(request_id)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[RequestRecord]:
        return iter(list(self._live.values()))

    def __contains__(self, rec: object) -> bool:
        return isinstance(rec, RequestRecord) and self._live.get(rec.id) is rec

    def counts_by_state(self) -> dict[str, int]:
        """Live records per state (a terminal one stays live until its call closes)."""
        counts = dict.fromkeys((s.value for s in State), 0)
        for rec in self._live.values():
            counts[rec.state.value] += 1
        return counts

    def counts(self) -> dict[str, int]:
        """Live records per state; for done and error, every record that ended there so
        far (``/debug``'s counts)."""
        counts = self.counts_by_state()
        counts[State.DONE.value] += self.finished
        counts[State.ERROR.value] += sum(self.failed.values())
        return counts
