"""The access log (``--access-log -|FILE``, ``--access-log-format json|common``): one line
per finished request, written when its HTTP exchange ends.

An exchange that made generate calls gets one line per call: its rid, how it ended
(``done`` or the error cause, ``client_gone`` included), prompt, output and cached
tokens, time to first token, and the exchange's total time; a WebSocket session, one line
per generation on it when the socket closes. An exchange without a call (a 400 from the
checks, a 503, a probe, ``/metrics``) gets one line with its status. Never the prompt
text unless ``--log-requests`` asks for it.

A write that fails (a full disk, a closed stderr) is logged once and turns the access log
off: the line is written as the exchange ends, inside the handler, and must never turn
an answered request (or ``/health``) into a 500.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import orjson

from lifecycle.core.states import State
from lifecycle.tracing.metrics import record_timings

if TYPE_CHECKING:
    from lifecycle.core.call import GenerateCall
    from lifecycle.core.frontend import Frontend
    from lifecycle.core.origin import Origin

__all__ = ["AccessLog"]

FORMATS = ("json", "common")

log = logging.getLogger("lifecycle.access")


class AccessLog:
    def __init__(
        self, frontend: Frontend, target: str, fmt: str = "json", log_requests: bool = False
    ) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"access log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt = fmt
        self.log_requests = log_requests
        self.target = target
        self.error: str | None = None  # why the access log was turned off
        self._own_fd = target != "-"
        self.fd = (
            os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if self._own_fd
            else sys.stderr.fileno()
        )
        frontend.events.subscribe(self)

    def begin(self, origin: Origin) -> None:
        """Collect the calls made for ``origin`` until ``end`` writes their lines."""
        origin.logged = []

    def end(self, origin: Origin, status: int) -> None:
        """Write the exchange's lines (``status`` -1: none, a WebSocket session's come
        from its own origin when the socket closes)."""
        calls, origin.logged = origin.logged, None
        if calls is None or status < 0:
            return
        total_ms = (time.monotonic() - origin.started) * 1e3
        lines = [self._line(origin, status, total_ms, c) for c in calls] or [
            self._line(origin, status, total_ms, None)
        ]
        self._write(b"".join(lines))

    def _write(self, data: bytes) -> None:
        if self.error is not None:
            return
        try:
            os.write(self.fd, data)
        except OSError as exc:
            self.error = str(exc)
            log.error("access log %s failed to write (%s): access logging is off until "
                      "restart; serving goes on", self.target, exc)  # fmt: skip

    def close(self) -> None:
        if self._own_fd:
            os.close(self.fd)
            self._own_fd = False

    def opened(self, call: GenerateCall) -> None:
        origin = call.origin
        if origin is not None and origin.logged is not None:
            origin.logged.append(call)

    def _line(
        self, origin: Origin, status: int, total_ms: float, call: GenerateCall | None
    ) -> bytes:
        req = origin.request
        rec: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "client": origin.client or "-",
            "method": req.method,
            "path": req.path,
            "route": origin.route,
            "status": status,
        }
        if not origin.per_call:  # a WebSocket generation is named by its own rid
            rec["request_id"] = origin.id
        if call is not None:
            rec.update(_call_fields(call))
            if self.log_requests:
                rec["prompt"] = [
                    i.text if i.text is not None else i.input_ids for i in call.req.items
                ]
        rec["total_ms"] = round(total_ms, 3)
        if self.fmt == "json":
            return orjson.dumps(rec) + b"\n"
        return _common(rec).encode() + b"\n"


def _call_fields(call: GenerateCall) -> dict[str, Any]:
    """How the call's requests ended: rids, outcome, tokens, time to first token."""
    rids, outcome, ttft = [], "done", None
    prompt = output = cached = 0
    for run in call.runs:
        rec = run.rec
        if rec.state is not State.DONE and outcome == "done":
            outcome = rec.cause.value if rec.cause is not None else rec.state.value
        t = record_timings(rec.trace, rec.created_ns).get("ttft")
        if t is not None:
            ttft = t if ttft is None else min(ttft, t)
        if run.samples:
            prompt += run.samples[0].prompt_tokens
            cached += run.samples[0].cached_tokens
        for s in run.samples:
            output += len(s.ids)
            rids.append(s.rid)
        if not run.samples:
            rids.append(rec.client_rid or rec.request_id or str(rec.id))
    return {
        "rid": rids[0] if len(rids) == 1 else rids,
        "outcome": outcome if call.runs else "invalid",
        "prompt_tokens": prompt,
        "output_tokens": output,
        "cached_tokens": cached,
        "ttft_ms": None if ttft is None else round(ttft * 1e3, 3),
    }


def _common(rec: dict[str, Any]) -> str:
    """NCSA common log format, our fields after it as key=value."""
    stamp = time.strftime("%d/%b/%Y:%H:%M:%S %z")
    host = rec["client"].rsplit(":", 1)[0]
    head = f'{host} - - [{stamp}] "{rec["method"]} {rec["path"]} HTTP/1.1" {rec["status"]} -'
    skip = {"time", "client", "method", "path", "status"}
    tail = " ".join(f"{k}={_kv(v)}" for k, v in rec.items() if k not in skip)
    return f"{head} {tail}"


def _kv(v: Any) -> str:
    if isinstance(v, list):
        return ",".join(str(x) for x in v)
    return "-" if v is None else str(v)
