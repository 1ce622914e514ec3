"""Questions asked of finished traces (the JSON of ``specs/trace.schema.json``).

Pure functions over lists of trace dicts, shared by ``lifecycle trace`` and the
``/debug/traces`` route: filter by time window and status, one request's timeline, the
slowest N by total or by time in one state, the requests that ended in one error cause,
and p50/p99 of the time spent in each state.
"""

from __future__ import annotations

import math
import re
import time
from datetime import datetime
from typing import Any

from lifecycle.core.states import Cause, State

__all__ = [
    "Trace",
    "filter_traces",
    "find",
    "key_candidates",
    "parse_time",
    "percentile",
    "slowest",
    "state_summary",
    "timeline",
    "with_cause",
]

Trace = dict[str, Any]
_RELATIVE = re.compile(r"^-?(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_time(text: str, now: float | None = None) -> float:
    """Unix seconds from ``1733140000.5``, an ISO 8601 time, or ``5m`` / ``-5m`` (ago)."""
    text = text.strip()
    m = _RELATIVE.match(text)
    if m:
        return (time.time() if now is None else now) - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return float(text)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(
            f"not a time: {text!r} (use unix seconds, ISO 8601, or an age like 5m)"
        ) from None


def finished_at(trace: Trace) -> float:
    return float(trace["created"]) + float(trace["total_ms"]) / 1e3


def _status_matches(trace: Trace, status: str) -> bool:
    if status.isdigit():
        return int(trace["status"]) == int(status)
    if status in (State.DONE.value, State.ERROR.value):
        return trace["state"] == status
    return trace["cause"] == status


def filter_traces(
    traces: list[Trace],
    *,
    since: float | None = None,
    until: float | None = None,
    status: str | None = None,
    route: str | None = None,
) -> list[Trace]:
    """Traces that finished in ``[since, until]`` and match ``status`` and ``route``.

    ``status`` is ``done``, ``error``, an error cause (``deadline``) or an HTTP status;
    ``route`` a route template (``/v1/chat/completions``).
    """
    if status is not None and not (
        status.isdigit() or status in ("done", "error") or status in {c.value for c in Cause}
    ):
        raise ValueError(f"unknown status {status!r}: done, error, a cause or an HTTP status")
    out = []
    for t in traces:
        end = finished_at(t)
        if since is not None and end < since:
            continue
        if until is not None and end > until:
            continue
        if status is not None and not _status_matches(t, status):
            continue
        if route is not None and t.get("route") != route:
            continue
        out.append(t)
    return out


# The reply ids made from a request id (docs/api.md, "Request ids").
_REPLY_PREFIXES = ("chatcmpl-", "cmpl-", "resp_", "msg_")
_SAMPLE = re.compile(r"^(.+)_\d+$")


def key_candidates(key: str) -> list[str]:
    """What ``key`` may name, most exact first: itself (an internal id, a client rid, a
    request id); a reply id's request id (``chatcmpl-X``, ``cmpl-X``, ``resp_X``,
    ``msg_X`` -> ``X``); the request of a sample's ``meta_info.id`` (``X_1`` -> ``X``,
    n > 1); the first prompt of a batch named ``X`` (``X_0``)."""
    out = [key]
    for prefix in _REPLY_PREFIXES:
        if key.startswith(prefix) and len(key) > len(prefix):
            out.append(key[len(prefix) :])
            break
    base = out[-1]
    m = _SAMPLE.match(base)
    if m is not None:
        out.append(m.group(1))
    out.append(base + "_0")
    return list(dict.fromkeys(out))


def find(traces: list[Trace], key: str) -> Trace | None:
    """The trace that ``key`` names: its internal id, client rid or request id, or an id
    made from those (``key_candidates``); the last one, if repeated."""
    for k in key_candidates(key):
        for t in reversed(traces):
            if str(t["id"]) == k or t["rid"] == k or t.get("request_id") == k:
                return t
    return None


def timeline(trace: Trace) -> list[dict[str, Any]]:
    """One row per state the request passed through: when it entered, how long it stayed,
    the event that took it out and that event's detail."""
    rows = []
    entered_ns, entered = trace["created_ns"], trace["created"]
    for tr in trace["transitions"]:
        rows.append(
            {
                "state": tr["src"],
                "entered": entered,
                "ms": (tr["t_ns"] - entered_ns) / 1e6,
                "event": tr["event"],
                "detail": tr["detail"],
            }
        )
        entered_ns, entered = tr["t_ns"], tr["time"]
    if trace["transitions"]:
        last = trace["transitions"][-1]
        rows.append(
            {"state": last["dst"], "entered": entered, "ms": 0.0, "event": None, "detail": None}
        )
    return rows


def slowest(traces: list[Trace], n: int, by: str = "total") -> list[Trace]:
    """The ``n`` slowest traces by total time, or by time spent in the state ``by``."""
    if by == "total":
        return sorted(traces, key=lambda t: t["total_ms"], reverse=True)[:n]
    if by not in {s.value for s in State}:
        raise ValueError(f"unknown state {by!r}")
    inside = [t for t in traces if by in t["states_ms"]]
    return sorted(inside, key=lambda t: t["states_ms"][by], reverse=True)[:n]


def with_cause(traces: list[Trace], cause: str) -> list[Trace]:
    if cause not in {c.value for c in Cause}:
        raise ValueError(f"unknown cause {cause!r}: one of {', '.join(c.value for c in Cause)}")
    return [t for t in traces if t["cause"] == cause]


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def state_summary(traces: list[Trace]) -> dict[str, dict[str, float]]:
    """Per live state: how many traces passed through it, and p50/p99/max ms spent there."""
    spent: dict[str, list[float]] = {}
    for t in traces:
        for state, ms in t["states_ms"].items():
            spent.setdefault(state, []).append(ms)
    order = [s.value for s in State]
    return {
        state: {
            "count": len(spent[state]),
            "p50_ms": percentile(spent[state], 50),
            "p99_ms": percentile(spent[state], 99),
            "max_ms": max(spent[state]),
        }
        for state in order
        if state in spent
    }
