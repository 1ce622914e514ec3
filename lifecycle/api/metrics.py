"""``GET /metrics``: the Prometheus exposition of the app's ``Metrics``
(``lifecycle.tracing.metrics``; docs/metrics.md); under ``serve --frontends N`` every
frontend's (``lifecycle.tracing.shared_metrics``)."""

from __future__ import annotations

from lifecycle.tracing.metrics import Metrics
from lifecycle.tracing.shared_metrics import SharedMetrics
from transport import Request, Response, Router

__all__ = ["install_metrics"]


def install_metrics(router: Router, metrics: Metrics, shared: SharedMetrics | None = None) -> None:
    async def scrape(request: Request) -> Response:
        body, content_type = await metrics.render()
        if shared is not None:
            shared.publish(body)
            body = shared.merged(body)
        return Response(body, 200, content_type=content_type)

    router.add("GET", "/metrics", scrape)
