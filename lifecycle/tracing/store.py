"""Finished request traces: their JSON shape, the bounded ring and the rotating log.

No clocks are read and no tasks run here: ``Tracer`` (``lifecycle/tracing/tracer.py``) feeds
these with records and the times it already has. One trace is the JSON object described
by ``specs/trace.schema.json``; the ring keeps the last few hundred of them readable from
``/debug/requests/{id}``, the log keeps every one, one line each.
"""

from __future__ import annotations

import enum
import heapq
import os
from collections import deque
from pathlib import Path
from typing import IO, Any

import orjson

from lifecycle.core.fsm import RequestRecord
from lifecycle.core.states import State
from lifecycle.tracing.replay import sampling_json

__all__ = [
    "HANDOFFS",
    "FinishedTrace",
    "TraceLog",
    "TraceRing",
    "detail_json",
    "live_summary",
    "read_log",
]

# Handoff name -> the event that marks it. The worker's release is the FINISH edge (its
# terminal step entry) or, after an error, its answer to the abort (``released_ns``).
HANDOFFS: dict[str, str] = {
    "admitted": "admit",
    "dispatched": "dispatch",
    "first_token": "first_token",
    "worker_released": "worker_released",
}
_DETAIL_CHARS = 200


def detail_json(detail: Any) -> Any:
    """A transition's detail as JSON: scalars as they are, enums by value, objects by type."""
    if isinstance(detail, str):
        return detail[:_DETAIL_CHARS]
    if detail is None or isinstance(detail, bool | int | float):
        return detail
    if isinstance(detail, enum.Enum):
        return detail._value_
    return type(detail).__name__  # e.g. the AdmissionQueue an admit edge carries


def _wall(t_ns: int, offset_ns: int) -> float:
    return (t_ns + offset_ns) / 1e9


class FinishedTrace:
    """A terminal record plus what the tracer learned around it; turned into JSON on read."""

    __slots__ = ("rec", "finished_ns", "extra", "logged")

    def __init__(self, rec: RequestRecord, finished_ns: int, extra: dict[str, Any]) -> None:
        self.rec = rec
        self.finished_ns = finished_ns
        self.extra = extra
        self.logged = False  # handed to the trace log (or skipped for good) already

    @property
    def total_ns(self) -> int:
        return self.finished_ns - self.rec.created_ns

    @property
    def failed(self) -> bool:
        return self.rec.state is State.ERROR

    def to_json(self, offset_ns: int) -> dict[str, Any]:
        # Enum members' ``_value_`` is a plain attribute; ``.value`` is a descriptor call
        # that cost a third of this function (one log line per request runs it).
        rec = self.rec
        transitions = []
        states: dict[str, float] = {}
        at: dict[str, int] = {}
        entered = rec.created_ns
        for t, src, dst, ev, d in rec._trace:
            name = src._value_
            transitions.append(
                {
                    "t_ns": t,
                    "time": (t + offset_ns) / 1e9,
                    "src": name,
                    "dst": dst._value_,
                    "event": ev._value_,
                    "detail": None if d is None else detail_json(d),
                }
            )
            states[name] = states.get(name, 0.0) + (t - entered) / 1e6
            at[ev._value_] = entered = t
        if rec.released_ns is not None:
            at["worker_released"] = rec.released_ns
        elif "finish" in at:
            at["worker_released"] = at["finish"]
        handoffs = {
            name: None if (h := at.get(event)) is None else {"t_ns": h, "time": _wall(h, offset_ns)}
            for name, event in HANDOFFS.items()
        }
        cause, extra = rec.cause, self.extra
        tokens = extra.get("tokens")
        first = at.get("first_token")
        wait = extra.get("model_wait")
        out: dict[str, Any] = {
            "id": rec.id,
            "model": extra.get("model"),
            "rid": rec.client_rid,
            "request_id": rec.request_id,
            "route": rec.route,
            "client": extra.get("client"),
            "state": rec.state._value_,
            "cause": cause._value_ if cause is not None else None,
            "status": extra.get("status") or (cause.status if cause is not None else 200),
            "message": rec.detail,
            "created_ns": rec.created_ns,
            "created": _wall(rec.created_ns, offset_ns),
            "finished_ns": self.finished_ns,
            "total_ms": self.total_ns / 1e6,
            "tokens": tokens,
            "prompt_tokens": extra.get("prompt_tokens"),
            "cached_tokens": extra.get("cached_tokens"),
            "speculative": extra.get("speculative"),
            "ttft_ms": None if first is None else (first - rec.created_ns) / 1e6,
            "tokens_per_s": _rate(tokens, first, self.finished_ns),
            "finish_reasons": extra.get("finish_reasons"),
            "params": _params(extra.get("sampling")),
            "worker": extra.get("worker"),
            "worker_index": extra.get("worker_index"),
            "model_wait_ms": None if wait is None else wait * 1e3,
            "states_ms": states,
            "transitions": transitions,
            "handoffs": handoffs,
        }
        prompt = extra.get("prompt")
        if prompt is not None:  # only with --trace-prompts: prompts may be private
            out["prompt"] = prompt
        replay = extra.get("replay")
        if replay is not None:  # only with --trace-prompts (lifecycle.tracing.replay)
            out["replay"] = replay
        return out


def _rate(tokens: int | None, first_ns: int | None, end_ns: int) -> float | None:
    """Output tokens per second from the first token to the end (the decode speed seen
    by the client); None before a first token or when no time passed."""
    if not tokens or first_ns is None or end_ns <= first_ns:
        return None
    return tokens / ((end_ns - first_ns) / 1e9)


_GRAMMARS = ("json_schema", "regex", "ebnf", "structural_tag")


def _params(sampling: Any) -> dict[str, Any] | None:
    """A request's sampling parameters as ``/generate`` takes them; a grammar's source is
    shortened to its size (a JSON schema may be kilobytes)."""
    if sampling is None:
        return None
    out = sampling_json(sampling)
    for name in _GRAMMARS:
        source = out.get(name)
        if isinstance(source, str) and len(source) > _DETAIL_CHARS:
            out[name] = f"({len(source)} characters)"
    return out


def live_summary(rec: RequestRecord, now_ns: int, extra: dict[str, Any]) -> dict[str, Any]:
    """One live request as ``/debug/requests`` lists it."""
    raw = rec._trace
    entered = raw[-1][0] if raw else rec.created_ns
    return {
        "id": rec.id,
        "model": extra.get("model"),
        "rid": rec.client_rid,
        "request_id": rec.request_id,
        "route": rec.route,
        "state": rec.state.value,
        "age_ms": (now_ns - rec.created_ns) / 1e6,
        "in_state_ms": (now_ns - entered) / 1e6,
        "tokens": extra.get("tokens"),
        "worker": extra.get("worker"),
        "held_by_worker": rec.held_by_worker,
    }


class TraceRing:
    """The last finished traces, bounded, keeping slow and failed ones preferentially.

    Three bounded parts share ``size`` slots: the most recent finishes (half), the most
    recent failures (a quarter) and the slowest by total time (a quarter, a min-heap). A
    trace in several parts is stored once, so at most ``size`` traces are held.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("ring size must be at least 1")
        self.size = size
        self._n_failed = size // 4
        self._n_slow = size // 4
        self._n_recent = size - self._n_failed - self._n_slow
        self._recent: deque[int] = deque()
        self._failed: deque[int] = deque()
        self._slow: list[tuple[int, int]] = []  # (total_ns, id), smallest on top
        self._items: dict[int, FinishedTrace] = {}
        self._refs: dict[int, int] = {}
        self._by_rid: dict[str, int] = {}
        self._by_request_id: dict[str, int] = {}  # the latest trace with that request id
        self._dropped: list[FinishedTrace] = []  # by the add under way

    def __len__(self) -> int:
        return len(self._items)

    def add(self, ft: FinishedTrace) -> list[FinishedTrace]:
        """Keep ``ft``; the traces that made room for it (``ft`` itself among them when it
        is kept by no part)."""
        self._dropped = []
        id = ft.rec.id
        self._items[id] = ft
        self._refs[id] = 0
        if ft.rec.client_rid is not None:
            self._by_rid[ft.rec.client_rid] = id
        if ft.rec.request_id is not None:
            self._by_request_id[ft.rec.request_id] = id
        self._push(self._recent, id, self._n_recent)
        if ft.failed:
            self._push(self._failed, id, self._n_failed)
        if self._n_slow:
            if len(self._slow) < self._n_slow:
                heapq.heappush(self._slow, (ft.total_ns, id))
                self._refs[id] += 1
            elif ft.total_ns > self._slow[0][0]:
                _, out = heapq.heapreplace(self._slow, (ft.total_ns, id))
                self._refs[id] += 1
                self._unref(out)
        if self._refs[id] == 0:
            self._drop(id)
        return self._dropped

    def _push(self, part: deque[int], id: int, limit: int) -> None:
        if not limit:
            return
        part.append(id)
        self._refs[id] += 1
        if len(part) > limit:
            self._unref(part.popleft())

    def _unref(self, id: int) -> None:
        self._refs[id] -= 1
        if self._refs[id] == 0:
            self._drop(id)

    def _drop(self, id: int) -> None:
        ft = self._items.pop(id)
        self._dropped.append(ft)
        del self._refs[id]
        rid = ft.rec.client_rid
        if rid is not None and self._by_rid.get(rid) == id:
            del self._by_rid[rid]
        rid = ft.rec.request_id
        if rid is not None and self._by_request_id.get(rid) == id:
            del self._by_request_id[rid]

    def get(self, id: int) -> FinishedTrace | None:
        return self._items.get(id)

    def by_rid(self, rid: str) -> FinishedTrace | None:
        """By the client's rid, else by request id (``X-Request-Id`` and the like)."""
        id = self._by_rid.get(rid)
        if id is None:
            id = self._by_request_id.get(rid)
        return None if id is None else self._items.get(id)

    def all(self) -> list[FinishedTrace]:
        """Every held trace, in the order they finished."""
        return sorted(self._items.values(), key=lambda ft: ft.finished_ns)


class TraceLog:
    """One JSON line per finished request, rotated by size like ``RotatingFileHandler``.

    ``path`` grows to ``max_bytes``, then becomes ``path.1`` (``path.1`` becomes
    ``path.2``, ...) and ``backups`` old files are kept. Lines are buffered and reach
    the file on ``flush()`` (the tracer's tick) or when the buffer fills.

    Every method may raise ``OSError`` (a full disk, a directory removed) or
    ``ValueError`` (the file closed by an earlier failure); the tracer then calls
    ``abandon()`` and logs nothing more. A log moved away by someone else is not an
    error: lines go on to the moved file until the next rotation opens ``path`` anew.
    """

    def __init__(self, path: str | Path, max_bytes: int = 64 << 20, backups: int = 3) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.backups = backups
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[bytes] = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115
        self._size = self._file.tell()
        self.rotations = 0

    def write(self, trace: dict[str, Any]) -> None:
        line = orjson.dumps(trace) + b"\n"
        if self._size and self._size + len(line) > self.max_bytes:
            self._rotate()
        self._file.write(line)
        self._size += len(line)

    def _rotate(self) -> None:
        self._file.close()
        if self.backups > 0:
            for i in range(self.backups - 1, 0, -1):
                older = self.path.with_name(f"{self.path.name}.{i}")
                if older.exists():
                    os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
            if self.path.exists():  # else moved away meanwhile: nothing to keep here
                os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
        else:
            self.path.unlink(missing_ok=True)
        self._file = open(self.path, "ab", buffering=1 << 16)  # noqa: SIM115
        self._size = 0
        self.rotations += 1

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def abandon(self) -> None:
        """Close after a failure, dropping what the buffer still holds (a buffered file
        closes its descriptor even when the last flush fails)."""
        try:
            self._file.close()
        except (OSError, ValueError):
            pass


def read_log(path: str | Path, *, rotated: bool = True) -> list[dict[str, Any]]:
    """Every trace in a log, oldest first; with ``rotated``, its ``.N`` backups too."""
    path = Path(path)
    files = []
    if rotated:
        n = 1
        while (backup := path.with_name(f"{path.name}.{n}")).exists():
            files.append(backup)
            n += 1
        files.reverse()
    files.append(path)
    traces: list[dict[str, Any]] = []
    for f in files:
        with open(f, "rb") as fh:
            traces.extend(orjson.loads(line) for line in fh if line.strip())
    return traces
