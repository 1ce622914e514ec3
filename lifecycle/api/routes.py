"""The app's router: every route it is given gets API-key checks and request metrics.

Wrapping at ``add`` time keys each handler by its route template (``/v1/models/{id}``,
not the path a client sent), so every module that installs routes on this router gets
auth and metrics without knowing about either, and the ``endpoint`` label stays bounded.
"""

from __future__ import annotations

from collections.abc import Iterable

from lifecycle.api.auth import Auth
from lifecycle.api.metrics import Metrics
from transport import Handler, HTTPError, Request, Response, Router

__all__ = ["AppRouter", "UNMATCHED"]

UNMATCHED = "(unmatched)"  # the endpoint label of a request no route took (404, 405)


class AppRouter(Router):
    def __init__(self, auth: Auth, metrics: Metrics | None = None) -> None:
        super().__init__()
        self.auth = auth
        self.metrics = metrics

    def add(self, methods: str | Iterable[str], path: str, handler: Handler) -> None:
        super().add(methods, path, self._guard(path, handler))

    def _guard(self, route: str, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            denied = self.auth.check_route(request, route)
            if denied is not None:
                self._observe(route, request, denied.status)
                return denied
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

        return guarded

    def _observe(self, route: str, request: Request, status: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_http(route, request.method, status)

    async def __call__(self, request: Request) -> Response:
        try:
            return await super().__call__(request)
        except HTTPError as exc:
            if not getattr(exc, "observed", False):
                self._observe(UNMATCHED, request, exc.status)
            raise
