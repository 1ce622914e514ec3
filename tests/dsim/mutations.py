"""Deliberately broken builds: one monkeypatch per invariant, to prove it can fail.

Each ``Mutation`` names the invariant it must trip and patches one specific piece of
the product to be wrong for the length of a ``with`` block. ``tests/test_dsim.py``
runs seeds under each until the simulation reports that invariant (and fails if it
never does); ``python -m tests.dsim --mutate NAME`` does the same by hand.
``abort_lost_in_tokenize`` is the planted bug of issue 37 item 5 reintroduced.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from lifecycle.core.call_state import CallState, _Sink
from lifecycle.core.frontend import Frontend
from lifecycle.core.registry import Registry
from lifecycle.core.states import Cause
from lifecycle.link.supervisor import Supervisor
from lifecycle.link.worker_client import WorkerClient

__all__ = ["MUTATIONS", "Mutation", "mutated"]


@dataclass(frozen=True, slots=True)
class Mutation:
    name: str
    invariant: str  # the invariant the simulation must report
    what: str
    patches: Callable[[], list[tuple[Any, str, Any]]]  # (owner, attribute, replacement)


def _abort_lost_in_tokenize() -> list[tuple[Any, str, Any]]:
    real = CallState.abort

    def abort(self: Any, message: str, rec_id: int | None = None) -> None:
        if any(run.sub is None for run in self.runs):
            return  # the bug: an abort that comes while the prompt is tokenized is dropped
        real(self, message, rec_id)

    return [(CallState, "abort", abort)]


def _live_call_leak() -> list[tuple[Any, str, Any]]:
    real = Frontend.closed

    def closed(self: Any, call: Any) -> None:
        untrack, self.calls.untrack = self.calls.untrack, lambda rec_id: None
        try:
            real(self, call)
        finally:
            self.calls.untrack = untrack

    return [(Frontend, "closed", closed)]


def _credit_leak() -> list[tuple[Any, str, Any]]:
    real = WorkerClient._end

    def end(self: Any, rid: int, reason: Any) -> None:
        held = rid in self._held
        real(self, rid, reason)
        if held and isinstance(reason, dict) and reason.get("type") == "abort":
            self._in_flight += 1  # the bug: an aborted rid's credit is never returned

    return [(WorkerClient, "_end", end)]


def _silent_failure() -> list[tuple[Any, str, Any]]:
    return [(CallState, "error", lambda self: None)]


def _unfinished_stream() -> list[tuple[Any, str, Any]]:
    from lifecycle.api import native

    async def events(self: Any, call: Any, incremental: bool) -> Any:
        async for frame in native.chunks(call, incremental):
            yield native.orjson.dumps(frame)
        call.close()  # the bug: no error event, no [DONE]

    return [(native.NativeAPI, "_events", events)]


def _token_miscount() -> list[tuple[Any, str, Any]]:
    real = _Sink.append

    def append(self: Any, ids: list[int], extra: Any = None) -> None:
        real(self, ids, extra)
        if len(ids) and self.rec.tokens == 2:
            self.rec.tokens += 1  # the bug: the second token is counted twice

    return [(_Sink, "append", append)]


def _rid_never_freed() -> list[tuple[Any, str, Any]]:
    real = Registry.remove

    def remove(self: Any, rec: Any) -> None:
        keep = self._by_rid.get(rec.client_rid) if rec.client_rid else None
        real(self, rec)
        if keep is not None and rec.cause is Cause.ABORTED:
            self._by_rid[rec.client_rid] = keep  # the bug: an aborted rid stays taken

    return [(Registry, "remove", remove)]


def _no_watchdog() -> list[tuple[Any, str, Any]]:
    async def watchdog(self: Any, client: Any) -> None:
        await anyio.sleep_forever()  # the bug: nothing ends a request lost on the way

    return [(Supervisor, "_watchdog", watchdog)]


def _abort_ends_internal() -> list[tuple[Any, str, Any]]:
    real = CallState._item_ended

    def item_ended(self: Any, run: Any) -> None:
        if not run.rec.terminal and any(
            (s.finish or {}).get("type") == "abort" for s in run.samples
        ):
            run.rec.fail(Cause.INTERNAL, "aborted")  # the bug: the wrong cause
            return
        real(self, run)

    return [(CallState, "_item_ended", item_ended)]


def _no_abort_on_close() -> list[tuple[Any, str, Any]]:
    def close(self: Any, cause: Cause = Cause.INTERNAL, detail: str | None = None) -> None:
        client, self.client = self.client, None  # the bug: no ABORT for what the worker holds
        try:
            real(self, cause, detail)
        finally:
            self.client = client

    real = CallState.close
    return [(CallState, "close", close)]


MUTATIONS = {
    m.name: m
    for m in (
        Mutation("abort_lost_in_tokenize", "aborts",
                 "an /abort_request arriving while the prompt is tokenized is lost",
                 _abort_lost_in_tokenize),
        Mutation("live_call_leak", "quiet", "a closed call stays in the live calls", _live_call_leak),
        Mutation("credit_leak", "worker_kept", "an aborted rid's worker credit is never returned",
                 _credit_leak),
        Mutation("silent_failure", "honest", "a failed call reports no error", _silent_failure),
        Mutation("unfinished_stream", "answered",
                 "a native stream that fails ends with neither an error event nor [DONE]",
                 _unfinished_stream),
        Mutation("token_miscount", "tokens", "the record counts a token twice", _token_miscount),
        Mutation("rid_never_freed", "rids", "an aborted request's rid stays taken",
                 _rid_never_freed),
        Mutation("no_watchdog", "no_hang", "no hung-worker watchdog and no AUDIT", _no_watchdog),
        Mutation("abort_ends_internal", "no_internal", "an aborted request ends internal",
                 _abort_ends_internal),
        Mutation("no_abort_on_close", "released",
                 "a call that closes (its client gone) sends the worker no ABORT",
                 _no_abort_on_close),
    )
}  # fmt: skip


@contextmanager
def mutated(name: str) -> Iterator[Mutation]:
    m = MUTATIONS[name]
    patches = m.patches()
    saved = [(owner, attr, owner.__dict__[attr]) for owner, attr, _ in patches]
    try:
        for owner, attr, new in patches:
            setattr(owner, attr, new)
        yield m
    finally:
        for owner, attr, old in saved:
            setattr(owner, attr, old)
