"""Client behaviours of the simulation and the checks on what a client read.

A flow drives one client through one scenario (``tests/simulation.py``): it sends, then
either reads to the end or leaves at the scenario's point, and returns the problems it
saw. What a complete reply must hold comes from the scripted worker's contract
(``lifecycle/testing/scripted_worker.py``): sample ``j`` of a prompt ``P`` is ``P`` repeated
cyclically from ``j`` on, ``max_new_tokens`` ids long (``ignore_eos``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import anyio

from lifecycle.core.states import Cause
from tests.sim_clients import Cut, HttpExchange, RawConn, SseEvents, WsClient, request_head

__all__ = ["Expect", "Outcome", "http_flow", "ws_flow", "expected_ids"]

_CAUSES = frozenset(c.value for c in Cause)
STALL_SLEEP = 0.9  # the server's send_timeout (0.5 s) and the time to fill its buffers
# Leave points that end a client before it read anything.
EARLY = frozenset({"after_send", "while_queued", "during_prefill", "rid_first"})


def expected_ids(prompts: list[list[int]], n: int, max_new: int) -> list[list[int]]:
    """The scripted worker's samples in reply order: n copies of the batch."""
    return [[p[(k + j) % len(p)] for k in range(max_new)] for j in range(n) for p in prompts]


@dataclass(frozen=True, slots=True)
class Expect:
    """What one client asked for and what a complete reply must hold."""

    api: str  # native | completions | chat (a WebSocket message type maps to these)
    stream: bool
    prompts: list[list[int]] | None  # token ids (native only); None: text prompts
    samples: int
    max_new: int
    n: int
    allowed: frozenset[int]  # error statuses that are a documented outcome here
    cut_ok: bool  # a fault cuts connections on purpose


@dataclass(slots=True)
class Outcome:
    problems: list[str]
    left: bool = False  # the client left before the end, on purpose
    status: int | None = None
    error: str | None = None  # the documented error it got, if any


# -- checks of a complete reply ------------------------------------------------------------
def _native_items(items: list[dict[str, Any]], e: Expect, ids_key: str = "output_ids") -> list[str]:
    assert e.prompts is not None
    want = expected_ids(e.prompts, e.n, e.max_new)
    if len(items) != len(want):
        return [f"{len(items)} samples, wanted {len(want)}"]
    out = []
    for i, (item, ids) in enumerate(zip(items, want, strict=True)):
        got = item.get(ids_key)
        if got != ids:
            at = next(
                (j for j, (a, b) in enumerate(zip(got or [], ids, strict=False)) if a != b), None
            )
            where = f"first differs at {at}" if at is not None else "lengths differ"
            out.append(f"sample {i}: {len(got or [])} ids, wanted {len(ids)}; {where}")
        finish = (item.get("meta_info") or {}).get("finish_reason") or {}
        if finish.get("type") != "length":
            out.append(f"sample {i}: finish_reason {finish}")
    return out


def check_unary(body: Any, e: Expect) -> list[str]:
    if e.api == "native":
        items = body if isinstance(body, list) else [body]
        if (e.samples > 1) != isinstance(body, list):
            return [f"reply shape {type(body).__name__} for {e.samples} samples"]
        return _native_items(items, e)
    choices = body.get("choices", [])
    out = []
    if sorted(c.get("index") for c in choices) != list(range(e.samples)):
        out.append(f"choice indices {[c.get('index') for c in choices]}")
    if any(c.get("finish_reason") != "length" for c in choices):
        out.append(f"finish reasons {[c.get('finish_reason') for c in choices]}")
    if body.get("usage", {}).get("completion_tokens") != e.samples * e.max_new:
        out.append(f"usage {body.get('usage')} for {e.samples} x {e.max_new} tokens")
    return out


def check_stream(events: list[dict[str, Any]], e: Expect) -> list[str]:
    if e.api == "native":  # cumulative frames: the last one of each index holds it all
        last: dict[int, dict[str, Any]] = {}
        for ev in events:
            last[ev.get("index", 0)] = ev
        return _native_items([last[i] for i in sorted(last)], e)
    finishes: dict[int, list[str]] = {}
    for ev in events:
        for c in ev.get("choices", []):
            if c.get("finish_reason") is not None:
                finishes.setdefault(c["index"], []).append(c["finish_reason"])
    want = {i: ["length"] for i in range(e.samples)}
    return [] if finishes == want else [f"finish reasons by index {finishes}, wanted {want}"]


def check_ws(deltas: list[dict[str, Any]], done: dict[str, Any], e: Expect) -> list[str]:
    by_index: dict[int, list[dict[str, Any]]] = {}
    for d in deltas:
        by_index.setdefault(d.get("index", 0), []).append(d)
    if sorted(by_index) != list(range(e.samples)):
        return [f"deltas for indices {sorted(by_index)}, wanted {e.samples}"]
    if e.prompts is not None:
        items = [
            {
                "output_ids": [t for d in ds for t in d["output_ids"]],
                "meta_info": ds[-1]["meta_info"],
            }
            for _, ds in sorted(by_index.items())
        ]
        return _native_items(items, e)
    counts = [ds[-1]["meta_info"]["completion_tokens"] for _, ds in sorted(by_index.items())]
    return [] if counts == [e.max_new] * e.samples else [f"completion_tokens {counts}"]


def _error_problem(err: Any, status: int | None, e: Expect) -> str | None:
    """None when ``err`` is a documented error body with an allowed status."""
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return f"malformed error body {err!r}"
    code = status if status is not None else err.get("code")
    if isinstance(code, str) and code in _CAUSES:  # OpenAI stream errors carry the cause
        code = Cause(code).status
    if code not in e.allowed:
        return f"error {code}: {err.get('message')}"
    return None


# -- HTTP ------------------------------------------------------------------------------------
async def http_flow(
    port: int, path: str, body: dict[str, Any], e: Expect, behaviour: str, k: int, delay: float,
    *, rst: bool,
) -> Outcome:  # fmt: skip
    raw = json.dumps(body).encode()
    conn = await RawConn.connect(port, rcvbuf=4096 if behaviour == "stall" else None)
    try:
        return await _http(conn, path, raw, e, behaviour, k, delay)
    except Cut as exc:
        if e.cut_ok:
            return Outcome([], left=True)
        return Outcome([f"connection cut while reading: {exc}"])
    finally:
        conn.close(rst=rst)


async def _http(
    conn: RawConn, path: str, raw: bytes, e: Expect, behaviour: str, k: int, delay: float
) -> Outcome:
    keep_alive = behaviour == "after_last"  # the server still holds the socket when we go
    if behaviour == "partial_body":
        await conn.send_all(request_head("POST", path, len(raw) + 1 + k, keep_alive=False))
        await conn.send_all(raw[: k % max(1, len(raw))])
        await anyio.sleep(delay)
        return Outcome([], left=True)
    ex = HttpExchange(conn)
    await ex.send("POST", path, raw, keep_alive=keep_alive)
    if behaviour in EARLY:
        await anyio.sleep(delay)
        return Outcome([], left=True)
    if behaviour == "stall":
        await anyio.sleep(STALL_SLEEP + delay)
    status = await ex.head()
    if behaviour == "after_head":
        return Outcome([], left=True, status=status)
    stream = e.stream and ex.headers.get("content-type", "").startswith("text/event-stream")
    sse, parts = SseEvents(), []
    try:
        async for chunk in ex.chunks():
            parts.append(chunk)
            if stream:
                sse.feed(chunk)
            if behaviour == "between_chunks" and ex.body_bytes >= k:
                return Outcome([], left=True, status=status)
    except Cut:
        if behaviour == "stall":  # cut by send_timeout: what the stall is for
            return Outcome([], left=True, status=status)
        raise
    if stream:
        return _stream_outcome(sse, status, e)
    return _unary_outcome(b"".join(parts), status, e)


def _stream_outcome(sse: SseEvents, status: int, e: Expect) -> Outcome:
    if not sse.done:
        return Outcome(
            [f"stream ended without [DONE] after {len(sse.events)} events"], status=status
        )
    errs = [ev["error"] for ev in sse.events if "error" in ev]
    if errs:
        problem = _error_problem(errs[0], None, e)
        if "error" not in sse.events[-1]:
            problem = problem or "events after the error event"
        return Outcome([problem] if problem else [], status=status, error=str(errs[0].get("type")))
    return Outcome(check_stream(sse.events, e), status=status)


def _unary_outcome(raw: bytes, status: int, e: Expect) -> Outcome:
    try:
        body = json.loads(raw)
    except ValueError:
        return Outcome([f"status {status}: body is not JSON: {raw[:200]!r}"], status=status)
    if status == 200:
        return Outcome(check_unary(body, e), status=status)
    err = body.get("error") if isinstance(body, dict) else None
    problem = _error_problem(err, status, e)
    return Outcome([problem] if problem else [], status=status, error=str(status))


# -- WebSocket -------------------------------------------------------------------------------
async def ws_flow(
    port: int, msg: dict[str, Any], e: Expect, behaviour: str, k: int, delay: float, *, rst: bool
) -> Outcome:
    conn = await RawConn.connect(port, rcvbuf=4096 if behaviour == "stall" else None)
    ws = WsClient(conn)
    try:
        await ws.handshake()
        return await _ws(ws, msg, e, behaviour, k, delay)
    except Cut as exc:
        if e.cut_ok or behaviour == "stall":
            return Outcome([], left=True)
        return Outcome([f"WebSocket cut while reading: {exc}"])
    finally:
        conn.close(rst=rst)


async def _ws(
    ws: WsClient, msg: dict[str, Any], e: Expect, behaviour: str, k: int, delay: float
) -> Outcome:
    if behaviour == "partial_body":
        frame = ws.message_bytes(msg)
        await ws.conn.send_all(frame[: 1 + k % (len(frame) - 1)])
        await anyio.sleep(delay)
        return Outcome([], left=True)
    await ws.send(msg)
    if behaviour in EARLY:
        await anyio.sleep(delay)
        return Outcome([], left=True)
    if behaviour == "stall":
        await anyio.sleep(STALL_SLEEP + delay)
    deltas: list[dict[str, Any]] = []
    while True:
        m = await ws.receive()
        if m.get("id") != msg["id"]:
            return Outcome([f"message for id {m.get('id')!r}: {m}"])
        if m["type"] != "delta":
            break
        deltas.append(m)
        if len(deltas) == k and behaviour in ("between_chunks", "ws_close", "ws_cancel"):
            if behaviour == "between_chunks":
                return Outcome([], left=True)
            if behaviour == "ws_close":
                await ws.send_close()
                return Outcome([], left=True)
            await ws.send({"type": "cancel", "id": msg["id"]})
    problems = await _after_terminal(ws, behaviour)
    if m["type"] == "done":
        return Outcome(problems + check_ws(deltas, m, e))
    if m["type"] != "error":
        return Outcome([*problems, f"unknown message type {m['type']!r}"])
    if behaviour == "ws_cancel" and m["error"].get("type") == "aborted":
        return Outcome(problems, error="aborted")
    problem = _error_problem(m.get("error"), None, e)
    return Outcome(problems + ([problem] if problem else []), error=str(m["error"].get("type")))


async def _after_terminal(ws: WsClient, behaviour: str) -> list[str]:
    """Close the socket properly (after_last just leaves); nothing may follow the terminal."""
    if behaviour == "after_last":
        return []
    await ws.send_close()
    extra: list[dict[str, Any]] = []
    with anyio.move_on_after(2.0):
        try:
            while True:
                extra.append(await ws.receive())
        except Cut:
            return [f"messages after the terminal one: {extra}"] if extra else []
    return ["the server did not close the WebSocket after our close"]
