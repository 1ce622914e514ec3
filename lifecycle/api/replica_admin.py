"""The admin routes that read and set how many Ray replicas serve a model
(``lifecycle serve --ray``; ``lifecycle.link.ray_replicas``):

- ``GET /replicas``: ``{"model", "count", "autoscale", "replicas"}``: the count wanted,
  ``--ray-autoscale``'s bounds (null without it), and each replica not removed (its
  index, node, actor, address and state: starting, ready, draining...).
- ``POST /replicas`` ``{"count": N}``: the same, at once, after asking for N replicas:
  new ones are placed and routed to once ready; surplus ones are drained (no new
  request goes to them, the ones they hold finish whole), then removed. 400 for a
  count outside 1..64, or outside ``--ray-autoscale``'s bounds (the autoscaler goes on
  from the count asked for).

Both take the model by name (``"model"`` in the body, ``?model=`` on GET; default the
first served). A server without ``--ray`` answers 400 naming the option.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lifecycle.api.calls import error_response
from lifecycle.api.model_routes import not_found
from lifecycle.core.frontend import Frontend
from lifecycle.core.ports import RayReplicas
from transport import JSONResponse, Request, Response, Router

__all__ = ["install_replica_admin"]

_NOT_RAY = (
    "this server's workers are not Ray replicas: serve with --ray (and --ray-autoscale "
    "MIN:MAX to scale on the queue) to set their number"
)


def install_replica_admin(router: Router, frontends: Mapping[str, Frontend]) -> None:
    """``frontends``: each model's, by its id (the first: the default)."""

    def replicas_of(name: Any) -> RayReplicas | Response:
        if name is None:
            name = next(iter(frontends), None)
        if not isinstance(name, str) or name not in frontends:
            return not_found(str(name))
        workers = frontends[name].supervisor
        if not isinstance(workers, RayReplicas):
            return error_response(400, _NOT_RAY)
        return workers

    def answer(name: str | None, workers: RayReplicas) -> Response:
        return JSONResponse({"model": name or next(iter(frontends)), **workers.scaling()})

    async def show(request: Request) -> Response:
        names = request.query().get("model")
        name = names[0] if names else None
        workers = replicas_of(name)
        if isinstance(workers, Response):
            return workers
        return answer(name, workers)

    async def scale(request: Request) -> Response:
        body: Any = await request.json()  # HTTPError 400 when it is no JSON
        if not isinstance(body, dict):
            return error_response(400, 'the body must be a JSON object with "count": replicas')
        name = body.get("model")
        workers = replicas_of(name)
        if isinstance(workers, Response):
            return workers
        count = body.get("count")
        if type(count) is not int:
            return error_response(400, '"count" must be an integer: the replicas wanted')
        try:
            workers.scale(count)
        except ValueError as exc:
            return error_response(400, str(exc))
        return answer(name, workers)

    router.add("GET", "/replicas", show)
    router.add("POST", "/replicas", scale)
