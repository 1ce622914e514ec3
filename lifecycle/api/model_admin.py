"""The admin routes that load and unload a model by name (``lifecycle.link.model_set``; as
llama-server's router names them). With models loaded on demand (``--models-max``,
``--sleep-idle-seconds``):

- ``POST /models/load`` ``{"model": NAME}``: 200 ``{"model", "state": "loaded"}`` once
  it is loaded (at once when it was), after the least recently used model was unloaded
  to make room; 503 naming the cause when its load failed.
- ``POST /models/unload`` ``{"model": NAME}``: 200 ``{"model", "state": "unloaded"}``
  once its workers ended, after its requests that hold a worker finished (its new
  requests wait meanwhile, and load it again after); 400 for a model served by remote
  workers.

A name the server does not have: 404 ``model_not_found`` in OpenAI's shape. Without
those options every model is loaded at start and stays: ``/models/load`` answers its
state, ``/models/unload`` is a 400 that says which options allow it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lifecycle.api.calls import error_response
from lifecycle.api.model_routes import not_found
from lifecycle.core.errors import ServeError
from lifecycle.core.frontend import Frontend
from lifecycle.core.ports import ModelLoads
from transport import JSONResponse, Request, Response, Router

__all__ = ["install_model_admin"]


_STAYS = (
    "the models are loaded at start and stay: serve with --models-max or "
    "--sleep-idle-seconds to load and unload them"
)


def install_model_admin(
    router: Router, models: ModelLoads | None, frontends: Mapping[str, Frontend]
) -> None:
    """``models``: the server's model set (None: every model stays loaded);
    ``frontends``: each model's, by its id."""

    async def load(request: Request) -> Response:
        name = await _model_of(request)
        if isinstance(name, Response):
            return name
        if models is None:
            return JSONResponse({"model": name, "state": frontends[name].model_state()})
        try:
            slot = await models.load(name)
        except ServeError as exc:
            return error_response(exc.cause.status, exc.message, exc.cause.retry_after)
        return JSONResponse({"model": slot.name, "state": slot.state})

    async def unload(request: Request) -> Response:
        name = await _model_of(request)
        if isinstance(name, Response):
            return name
        if models is None:
            return error_response(400, _STAYS)
        try:
            slot = await models.unload(name)
        except ValueError as exc:
            return error_response(400, str(exc))
        return JSONResponse({"model": slot.name, "state": slot.state})

    async def _model_of(request: Request) -> str | Response:
        body: Any = await request.json()  # HTTPError 400 when it is no JSON
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return error_response(400, 'the body must be a JSON object with "model": a model name')
        return name if name in frontends else not_found(name)

    router.add("POST", "/models/load", load)
    router.add("POST", "/models/unload", unload)
