"""Which calls are live: the one record of it, for the API modules and the drain.

A call is live from its first record's registration until it closes. ``LiveCalls``
maps each record id to the call that owns it (a batch call owns several) and is what
``/abort_request``, the drain's wait and its cut ask; nobody keeps a copy. It also
remembers who made a call (``own``: an opaque owner, the API key's digest), so that an
abort on behalf of one owner never ends another's call.
"""

from __future__ import annotations

import weakref
from typing import Generic, Protocol, TypeVar

import anyio

from lifecycle.core.registry import Registry
from lifecycle.core.states import Cause

__all__ = ["ABORT_MESSAGE", "LiveCall", "LiveCalls"]

# The finish message of every request ended by ``/abort_request``, in whatever state
# (being tokenized, queued here, queued or running in the worker).
ABORT_MESSAGE = "Abort by the /abort_request API"


class LiveCall(Protocol):
    """What the live calls ask of a call (``lifecycle.core.call.GenerateCall``)."""

    def abort(self, message: str, rec_id: int | None = None) -> None: ...

    def interrupt(self, cause: Cause, message: str) -> None: ...

    def expire_if_overdue(self) -> bool: ...


C = TypeVar("C", bound=LiveCall)
DEADLINE_CHECK_S = 0.1  # how soon a deadline passed while the owner waits elsewhere is seen


class LiveCalls(Generic[C]):
    """Record id -> the call that owns it, for every record whose call has not closed."""

    __slots__ = ("_registry", "_by_record", "_none_left", "_owners")

    def __init__(self, registry: Registry) -> None:
        self._registry = registry  # client rid -> record, for ``abort``
        self._by_record: dict[int, C] = {}
        self._none_left: anyio.Event | None = None
        # call -> who made it; weak, so a call that closes takes its entry along
        self._owners: weakref.WeakKeyDictionary[C, object] = weakref.WeakKeyDictionary()

    def own(self, call: C, owner: object) -> None:
        """Record who made ``call`` (None: nobody in particular, no keys configured)."""
        if owner is not None:
            self._owners[call] = owner

    def track(self, rec_id: int, call: C) -> None:
        self._by_record[rec_id] = call

    def of(self, rec_id: int) -> C | None:
        """The live call that owns record ``rec_id`` (until it closes)."""
        return self._by_record.get(rec_id)

    def untrack(self, rec_id: int) -> None:
        self._by_record.pop(rec_id, None)
        if not self._by_record and self._none_left is not None:
            self._none_left.set()

    def __len__(self) -> int:
        """How many calls are live."""
        return len(self.calls())

    def calls(self) -> list[C]:
        """Every live call once (a batch call owns several records)."""
        return list({id(c): c for c in self._by_record.values()}.values())

    def abort(
        self, client_rid: str | None = None, *, abort_all: bool = False, owner: object = None
    ) -> int:
        """``/abort_request``: end the request named by its client rid (else every live
        call with that request id, the ``X-Request-Id`` it came with), or every live one;
        with ``owner``, only among the calls that owner made (another's rid is as good as
        unknown). Each ends with finish_reason abort (its partial output); returns how many."""
        message = ABORT_MESSAGE
        if abort_all:
            calls = [c for c in self.calls() if owner is None or self._owners.get(c) == owner]
            for each in calls:
                each.abort(message)
            return len(calls)
        if not client_rid:
            return 0
        rec = self._registry.by_client_rid(client_rid)
        if rec is None:  # a request id: the whole call of each exchange that sent it
            named = {id(c): c for c in self.calls() if getattr(c, "request_id", None) == client_rid}
            for r in self._registry:  # a call without one of its own: its records'
                if r.request_id == client_rid and (c := self._by_record.get(r.id)) is not None:
                    named[id(c)] = c
            calls = [c for c in named.values() if owner is None or self._owners.get(c) == owner]
            for each in calls:
                each.abort(message)
            return len(calls)
        call = self._by_record.get(rec.id)
        if call is None or (owner is not None and self._owners.get(call) != owner):
            return 0
        call.abort(message, rec.id)
        return 1

    async def wait_drained(self, timeout: float) -> bool:
        """Wait until no call is live, at most ``timeout`` seconds; True if none is."""
        with anyio.move_on_after(timeout):
            while self._by_record:
                self._none_left = anyio.Event()
                await self._none_left.wait()
        return not self._by_record

    async def watch_deadlines(self) -> None:
        """Forever: end calls whose deadline passed while their owner is blocked outside
        ``wait`` (a write to a client that does not read), every ``DEADLINE_CHECK_S``, so
        the worker stops at the deadline and the client gets the 504 error event once it
        reads again (``GenerateCall.expire_if_overdue``)."""
        while True:
            await anyio.sleep(DEADLINE_CHECK_S)
            self.expire_overdue()

    def expire_overdue(self) -> int:
        """End every call whose deadline passed while its owner waits elsewhere (a write
        to a client that does not read); returns how many were ended now."""
        return sum(1 for call in self.calls() if call.expire_if_overdue())

    def cut_all(self, cause: Cause, message: str) -> int:
        """End every live call with an explicit error its owner then sends (the drain
        timeout); returns how many were cut."""
        calls = self.calls()
        for call in calls:
            call.interrupt(cause, message)
        return len(calls)
