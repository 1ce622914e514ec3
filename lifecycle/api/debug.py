"""The debug routes: live requests, one request's trace, finished traces, the feed, the page.

``install_debug(router, tracer)`` adds::

    GET /debug                  the live page (lifecycle/tracing/static/debug.html)
    GET /debug/requests         live requests: state, age, time in state, tokens, worker;
                                the trace log's health and the tracer's failures
    GET /debug/requests/{key}   one request's trace, by internal id, client rid, request id
                                (X-Request-Id) or a reply id made from it (chatcmpl-...)
    GET /debug/traces           the finished traces the ring holds (the CLI's --url source;
                                ?since= &until= &status= &route=)
    GET /debug/feed             WebSocket: one JSON message per tick with every transition
    POST /debug/requests/{key}/replay   rerun a finished request from its trace (with
                                ``replay``: the server's ``replay_in_process``; docs/replay.md)

``auth`` is the server's admin check: called with the request, a false (or awaited
false) answer is a 401. Browsers cannot put headers on a WebSocket, so an auth hook that
should let the page in accepts the key as ``?key=`` too; the page forwards its own.
"""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable
from functools import cache
from importlib import resources
from typing import Any

import anyio

from lifecycle.tracing.query import filter_traces, parse_time
from lifecycle.tracing.replay import ReplayRefused
from lifecycle.tracing.tracer import Tracer
from transport import (
    HTTPError,
    JSONResponse,
    Request,
    Response,
    Router,
    WebSocket,
    WebSocketClosed,
    WebSocketResponse,
)
from transport.routing import Handler

__all__ = ["Auth", "Replay", "admin_auth", "install_debug", "page_html"]

Auth = Callable[[Request], bool | Awaitable[bool]]
# Reruns a finished request from its trace and reports how the new ids compare
# (``lifecycle.tracing.replay.compare``); raises ``ReplayRefused`` when it cannot.
Replay = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def admin_auth(key: str) -> Auth:
    """An auth hook for ``key``: ``Authorization: Bearer KEY`` or ``?key=KEY`` (the page)."""
    expected = key.encode()

    def check(request: Request) -> bool:
        header = request.headers.get("authorization") or ""
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":
            given = (request.query().get("key") or [""])[-1]
        return hmac.compare_digest(given.strip().encode(), expected)

    return check


@cache
def page_html() -> bytes:
    return resources.files("lifecycle.tracing").joinpath("static/debug.html").read_bytes()


def _guarded(handler: Handler, auth: Auth | None) -> Handler:
    if auth is None:
        return handler

    async def guarded(request: Request) -> Response:
        ok = auth(request)
        if inspect.isawaitable(ok):
            ok = await ok
        if not ok:
            raise HTTPError(401, "The debug routes need the admin key")
        return await handler(request)

    return guarded


def install_debug(
    router: Router,
    tracer: Tracer,
    *,
    enabled: bool = True,
    auth: Auth | None = None,
    replay: Replay | None = None,
) -> None:
    """Add the debug routes to ``router`` (nothing when ``enabled`` is false; the replay
    route only with ``replay``).

    The tracer must be installed (``with tracer:``) and its ``run()`` driver running for
    the feed to move; the other routes work without it.
    """
    if not enabled:
        return

    async def page(request: Request) -> Response:
        return Response(page_html(), content_type="text/html; charset=utf-8")

    async def requests(request: Request) -> Response:
        return JSONResponse({"counts": tracer.counts(), "requests": tracer.live(),
                             "trace_log": tracer.log_status(),
                             "tracer_errors": tracer.errors})  # fmt: skip

    def trace_of(request: Request) -> dict[str, Any]:
        key = request.path_params["key"]
        trace = tracer.lookup(key)
        if trace is None:
            raise HTTPError(404, f"No live or recorded request {key!r}")
        return trace

    async def one(request: Request) -> Response:
        return JSONResponse(trace_of(request))

    async def rerun(request: Request) -> Response:
        assert replay is not None
        try:
            return JSONResponse(await replay(trace_of(request)))
        except ReplayRefused as exc:
            raise HTTPError(exc.status, exc.message) from None

    async def traces(request: Request) -> Response:
        q = {k: v[-1] for k, v in request.query().items()}
        try:
            since = parse_time(q["since"]) if "since" in q else None
            until = parse_time(q["until"]) if "until" in q else None
            found = filter_traces(
                tracer.finished_traces(),
                since=since,
                until=until,
                status=q.get("status"),
                route=q.get("route"),
            )
        except ValueError as exc:  # a time or a status it cannot read: says which
            raise HTTPError(400, str(exc)) from None
        return JSONResponse({"traces": found})

    async def feed(request: Request) -> Response:
        return WebSocketResponse(lambda ws: _feed_session(ws, tracer))

    for path, handler in (
        ("/debug", page),
        ("/debug/requests", requests),
        ("/debug/requests/{key}", one),
        ("/debug/traces", traces),
        ("/debug/feed", feed),
    ):
        router.add("GET", path, _guarded(handler, auth))
    if replay is not None:
        router.add("POST", "/debug/requests/{key}/replay", _guarded(rerun, auth))


async def _feed_session(ws: WebSocket, tracer: Tracer) -> None:
    messages = tracer.subscribe()
    with messages:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_until_closed, ws, tg.cancel_scope)
            try:
                async for message in messages:
                    await ws.send(message.decode())
            except WebSocketClosed:
                pass
            tg.cancel_scope.cancel()


async def _until_closed(ws: WebSocket, scope: anyio.CancelScope) -> None:
    # The page sends nothing; reading is how its close (or a lost connection) is noticed.
    try:
        while True:
            await ws.receive()
    except WebSocketClosed:
        scope.cancel()
