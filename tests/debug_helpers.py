"""A real server with only the debug routes, and requests driven through the FSM by hand.

Until the full app is wired, this is how the debug routes and the page are exercised: a
transport ``Server`` serving ``install_debug`` over a ``Registry`` whose records a test
moves through the real state machine (the same calls the request path makes).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from lifecycle.api.debug import Auth, install_debug
from lifecycle.core.buffers import OutputBuffer
from lifecycle.core.fsm import RequestRecord, new_request
from lifecycle.core.registry import Registry
from lifecycle.core.states import Cause, Event
from lifecycle.core.submission import Submission
from lifecycle.tracing.probes import Probe, default_probe
from lifecycle.tracing.tracer import TraceConfig, Tracer
from transport import JSONResponse, Request, Response, Router, Server, ServerConfig

TO_STREAMING = (Event.VALIDATE, Event.ADMIT, Event.DISPATCH, Event.FIRST_TOKEN)


@dataclass
class DebugServer:
    port: int
    registry: Registry
    tracer: Tracer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(
        self,
        rid: str | None = None,
        upto: int = len(TO_STREAMING),
        *,
        request_id: str | None = None,
        route: str | None = None,
    ) -> RequestRecord:
        """A new request, registered and moved ``upto`` edges along the happy path; from
        dispatch on the worker holds it (a submission, as the dispatcher keeps one)."""
        rec = new_request(rid, request_id, route)
        self.registry.add(rec)
        for ev in TO_STREAMING[:upto]:
            if ev is Event.DISPATCH:
                sub = Submission(rec.id, [OutputBuffer(1)], None)
                sub.on_release = lambda: self.registry.worker_released(rec.id)
                sub.move("submit")
                sub.move("dispatch")
                rec.submission = sub
            rec.fire(ev)
        return rec

    def finish(self, rec: RequestRecord, cause: Cause | None = None) -> None:
        """End it (done, or error(cause)), let the worker go, and leave the registry."""
        if cause is None:
            rec.fire(Event.FINISH)
        else:
            rec.fail(cause, f"ended with {cause.value}")
        self.registry.remove(rec)
        if rec.held_by_worker:
            rec.submission.move("release")  # type: ignore[union-attr]


def _no_replicas(router: Router) -> None:
    async def server_info(request: Request) -> Response:
        return JSONResponse({})

    router.add("GET", "/server_info", server_info)


@asynccontextmanager
async def debug_server(
    *,
    auth: Auth | None = None,
    enabled: bool = True,
    probe: Probe = default_probe,
    routes: Callable[[Router], None] | None = None,
    **trace: Any,
) -> AsyncIterator[DebugServer]:
    """``routes``: installs more routes beside the debug ones; without it a stand-in
    ``/server_info`` with no Ray replicas (every real server has one: the page reads it)."""
    registry = Registry()
    tracer = Tracer(TraceConfig(**trace), registry=registry, probe=probe)
    router = Router()
    install_debug(router, tracer, enabled=enabled, auth=auth)
    (routes or _no_replicas)(router)
    server = Server(router, ServerConfig(port=0, shutdown_timeout=2))
    with tracer:
        async with anyio.create_task_group() as tg:
            tg.start_soon(tracer.run)
            bound = await tg.start(server.serve)
            try:
                yield DebugServer(bound[0][1], registry, tracer)
            finally:
                with anyio.fail_after(10):
                    await server.shutdown()
                tg.cancel_scope.cancel()
