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
    CALL_ORIGIN,
    EXCHANGE,
    REQUEST_ID_HEADER,
    Exchange,
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
            ex = EXCHANGE.get()
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
            if self.access_log is None:
                return await self._answer(route, handler, request, ex, generation)
            access = self.access_log
            token = access.begin(route, request)
            status = 500
            try:
                response = await self._answer(route, handler, request, ex, generation)
                status = response.status
                if isinstance(response, WebSocketResponse):
                    status = -1  # the session's own line comes when the socket closes
                    response.session = access.session(route, request, response.session)
                return response
            except HTTPError as exc:
                status = exc.status
                raise
            finally:
                access.end(token, status)

        return guarded

    async def _answer(
        self, route: str, handler: Handler, request: Request, ex: Exchange | None, generation: bool
    ) -> Response:
        if not generation:
            response = await self._handle(route, handler, request)
            if isinstance(response, WebSocketResponse) and ex is not None:
                response.session = _session(ex, response.session)
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

    def _refused(self, ex: Exchange | None, status: int, message: str) -> None:
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
        origin = CALL_ORIGIN.set(request)  # the calls this request makes came from it
        exchange = EXCHANGE.set(_exchange(request))
        try:
            return await super().__call__(request)
        except HTTPError as exc:
            if not getattr(exc, "observed", False):
                self._observe(UNMATCHED, request, exc.status)
            raise
        finally:
            EXCHANGE.reset(exchange)
            CALL_ORIGIN.reset(origin)


def _exchange(request: Request) -> Exchange:
    """The request's id (its valid ``X-Request-Id``, else a new one) and the header that
    carries it back on every answer."""
    given = client_request_id(request.headers.get(REQUEST_ID_HEADER))
    rid = given or new_request_id()
    headers = [(REQUEST_ID_HEADER, rid)]
    if request.response_headers:
        headers += request.response_headers
    request.response_headers = headers
    client = f"{request.client[0]}:{request.client[1]}" if request.client else None
    return Exchange(rid, given is not None, client=client, headers=headers)


def _session(ex: Exchange, run: Session) -> Session:
    """A WebSocket session whose generations know their route and client (each is a
    request with an id of its own: ``Exchange.per_call``)."""
    shared = Exchange(ex.id, ex.given, ex.route, ex.client, per_call=True)

    async def session(ws: WebSocket) -> None:
        token = EXCHANGE.set(shared)
        try:
            await run(ws)
        finally:
            EXCHANGE.reset(token)

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
