"""The app's router: every route it is given gets API-key checks and request metrics.

Wrapping at ``add`` time keys each handler by its route template (``/v1/models/{id}``,
not the path a client sent), so every module that installs routes on this router gets
auth and metrics without knowing about either, and the ``endpoint`` label stays bounded.

It also gives every request one id (docs/api.md, "Request ids"): the client's
``X-Request-Id``, else the body's ``rid`` (adopted by the call), else a new one; every
answer carries it back as ``X-Request-Id`` (the transport's ``response_headers``), and
the calls made for the request name their records by it (``lifecycle.core.origin``).
A generation request refused before it made a call (``GENERATION_ROUTES``: a body that
is not JSON, a wrong type, an unknown field, a 401) is recorded as a request that ended
in error (``lifecycle.core.call.reject``): traced, logged and counted like the others.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING

import orjson

from lifecycle.api.access_log import AccessLog
from lifecycle.api.anthropic_params import ANTHROPIC_ROUTES, anthropic_reply
from lifecycle.api.auth import Auth
from lifecycle.core.call import reject
from lifecycle.core.origin import (
    ORIGIN,
    REQUEST_ID_HEADER,
    Origin,
    client_request_id,
    new_request_id,
)
from lifecycle.core.states import Cause
from lifecycle.tracing.metrics import Metrics
from transport import (
    Handler,
    HTTPError,
    Request,
    Response,
    Router,
    WebSocket,
    WebSocketResponse,
)

if TYPE_CHECKING:
    from lifecycle.core.frontend import Frontend

__all__ = ["AppRouter", "GENERATION_ROUTES", "UNMATCHED", "rejection_cause"]

log = logging.getLogger("lifecycle.api.routes")

Session = Callable[[WebSocket], Awaitable[None]]

UNMATCHED = "(unmatched)"  # the endpoint label of a request no route took (404, 405)

# The routes whose requests become generate calls: one refused before its call is made
# is recorded as a request that ended in error (its trace, access-log line and counts).
GENERATION_ROUTES = frozenset(
    {
        "/generate",
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/encode",
        "/v1/score",
    }
)


def rejection_cause(status: int) -> Cause | None:
    """The cause a refused generation request is recorded with: ``unauthorized`` for a
    401 or 403, ``invalid`` for another 4xx, the cause with that status otherwise (a 503
    before the call: ``not_ready``); None for a status that is no refusal."""
    if status in (401, 403):
        return Cause.UNAUTHORIZED
    if 400 <= status < 500:
        return Cause.INVALID
    return next((c for c in Cause if c.status == status and status >= 500), None)


class AppRouter(Router):
    def __init__(
        self,
        auth: Auth,
        metrics: Metrics | None = None,
        access_log: AccessLog | None = None,
        frontend: Frontend | None = None,
    ) -> None:
        super().__init__()
        self.auth = auth
        self.metrics = metrics
        self.access_log = access_log
        self.frontend = frontend  # records refused generation requests (None: not recorded)

    def add(self, methods: str | Iterable[str], path: str, handler: Handler) -> None:
        super().add(methods, path, self._guard(path, handler))

    def _guard(self, route: str, handler: Handler) -> Handler:
        generation = route in GENERATION_ROUTES

        async def guarded(request: Request) -> Response:
            ex = ORIGIN.get()
            if ex is not None:
                ex.route = route
            denied = self.auth.check_route(request, route)
            if denied is not None and route in ANTHROPIC_ROUTES:
                denied = anthropic_reply(denied)  # Anthropic's clients read its envelope
            if denied is not None:
                self._observe(route, request, denied.status)
                if generation:
                    self._refused(ex, denied.status, _message(denied))
                return denied
            access = self.access_log
            if access is None or ex is None:
                return await self._answer(route, handler, request, ex, generation)
            access.begin(ex)
            status = 500
            try:
                response = await self._answer(route, handler, request, ex, generation)
                status = response.status
                if isinstance(response, WebSocketResponse):
                    status = -1  # the session's own lines come when the socket closes
                return response
            except HTTPError as exc:
                status = exc.status
                raise
            finally:
                access.end(ex, status)

        return guarded

    async def _answer(
        self, route: str, handler: Handler, request: Request, ex: Origin | None, generation: bool
    ) -> Response:
        if not generation:
            response = await self._handle(route, handler, request)
            if isinstance(response, WebSocketResponse) and ex is not None:
                response.session = _session(ex, response.session, self.access_log)
            return response
        try:
            response = await self._handle(route, handler, request)
        except HTTPError as exc:
            self._refused(ex, exc.status, _message(Response(exc.body, exc.status)))
            raise
        except Exception as exc:  # a bug before the call: the 500 is traced as internal
            self._refused(ex, 500, f"handler failed: {type(exc).__name__}")
            raise
        if response.status >= 400 and request.responded is None:
            self._refused(ex, response.status, _message(response))
        return response

    def _refused(self, ex: Origin | None, status: int, message: str) -> None:
        """A generation request answered ``status`` before it made a call: recorded as
        one that ended in error with the matching cause."""
        fe = self.frontend
        cause = rejection_cause(status)
        if fe is None or ex is None or ex.calls or cause is None:
            return
        try:
            reject(fe, cause, message, status)
        except Exception:  # recording it must never change the answer
            log.exception("recording a refused request failed")

    async def _handle(self, route: str, handler: Handler, request: Request) -> Response:
        try:
            response = await handler(request)
        except HTTPError as exc:
            exc.observed = True  # type: ignore[attr-defined]
            self._observe(route, request, exc.status)
            raise
        except Exception:
            self._observe(route, request, 500)
            raise
        self._observe(route, request, response.status)
        return response

    def _observe(self, route: str, request: Request, status: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_http(route, request.method, status)

    async def __call__(self, request: Request) -> Response:
        token = ORIGIN.set(_origin(request))  # the calls this request makes came from it
        try:
            return await super().__call__(request)
        except HTTPError as exc:
            if not getattr(exc, "observed", False):
                self._observe(UNMATCHED, request, exc.status)
            raise
        finally:
            ORIGIN.reset(token)


def _origin(request: Request) -> Origin:
    """The request's id (its valid ``X-Request-Id``, else a new one) and the header that
    carries it back on every answer."""
    given = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    rid = given or new_request_id()
    headers = [(REQUEST_ID_HEADER, rid)]
    if request.response_headers:
        headers += request.response_headers
    request.response_headers = headers
    return Origin(request, rid, given is not None, headers=headers)


def _session(ex: Origin, run: Session, access: AccessLog | None) -> Session:
    """A WebSocket session whose generations know their route and client (each is a
    request with an id of its own: ``Origin.per_call``); with an access log, one line
    per generation on it when the socket closes, status 101."""

    async def session(ws: WebSocket) -> None:
        shared = ex.session()
        token = ORIGIN.set(shared)
        if access is not None:
            access.begin(shared)
        try:
            await run(ws)
        finally:
            if access is not None:
                access.end(shared, 101)
            ORIGIN.reset(token)

    return session


def _message(response: Response) -> str:
    """An error response's message (``{"error": {"message": ...}}``), else its body."""
    try:
        body = orjson.loads(response.body)
        error = body.get("error") if isinstance(body, dict) else None
        message = error.get("message") if isinstance(error, dict) else error
        if isinstance(message, str):
            return message
    except (orjson.JSONDecodeError, TypeError):
        pass
    return response.body[:200].decode("utf-8", "replace") or f"HTTP {response.status}"
