"""``GET /metrics``: the Prometheus exposition of the app's ``Metrics``
(``lifecycle.tracing.metrics``; docs/metrics.md)."""

from __future__ import annotations

from lifecycle.tracing.metrics import Metrics
from transport import Request, Response, Router

__all__ = ["install_metrics"]


def install_metrics(router: Router, metrics: Metrics) -> None:
    async def scrape(request: Request) -> Response:
        body, content_type = await metrics.render()
        return Response(body, 200, content_type=content_type)

    router.add("GET", "/metrics", scrape)
