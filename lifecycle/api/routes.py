"""The app's router: every route it is given gets API-key checks and request metrics.

Wrapping at ``add`` time keys each handler by its route template (``/v1/models/{id}``,
not the path a client sent), so every module that installs routes on this router gets
auth and metrics without knowing about either, and the ``endpoint`` label stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable

from lifecycle.api.access_log import AccessLog
from lifecycle.api.auth import Auth
from lifecycle.api.metrics import Metrics
from lifecycle.core.origin import CALL_ORIGIN
from transport import Handler, HTTPError, Request, Response, Router, WebSocketResponse

__all__ = ["AppRouter", "UNMATCHED"]

UNMATCHED = "(unmatched)"  # the endpoint label of a request no route took (404, 405)


class AppRouter(Router):
    def __init__(
        self, auth: Auth, metrics: Metrics | None = None, access_log: AccessLog | None = None
    ) -> None:
        super().__init__()
        self.auth = auth
        self.metrics = metrics
        self.access_log = access_log

    def add(self, methods: str | Iterable[str], path: str, handler: Handler) -> None:
        super().add(methods, path, self._guard(path, handler))

    def _guard(self, route: str, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            denied = self.auth.check_route(request, route)
            if denied is not None:
                self._observe(route, request, denied.status)
                return denied
            if self.access_log is None:
                return await self._handle(route, handler, request)
            access = self.access_log
            token = access.begin(route, request)
            status = 500
            try:
                response = await self._handle(route, handler, request)
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
        try:
            return await super().__call__(request)
        except HTTPError as exc:
            if not getattr(exc, "observed", False):
                self._observe(UNMATCHED, request, exc.status)
            raise
        finally:
            CALL_ORIGIN.reset(origin)
