"""The routes of several models behind one handler (``--model`` repeated; the slots are
``lifecycle.app.slot_configs``): each request goes to the model its ``model``
names: the body's ``model`` on every route that generates (the native ``/generate``
too, POST or PUT), tokenizes or counts tokens (``BODY_MODEL_ROUTES``), the path's on
``/v1/models/{model}``, the query's (``?model=``) on the WebSocket upgrade (a socket
serves one model); a request that names none goes to the first model; a name no model
has is OpenAI's 404 ``model_not_found``. ``/v1/models`` lists every model; ``/health``
is 200 once every model is ready. What the server reports joins every model's answer:
``/metrics`` (one exposition, each model's series labelled ``model_name``),
``/server_info`` (the first model's at top level, every model's in ``models``) and
``/get_load`` (every model's workers). The debug routes are the first model's router's,
and its tracer watches every model. Every other route (admin) is the first model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson

from lifecycle.api.anthropic_params import ANTHROPIC_ROUTES, anthropic_reply
from lifecycle.api.auth import Auth
from lifecycle.api.openai import openai_error
from lifecycle.api.routes import GENERATION_ROUTES
from lifecycle.api.websocket import WS_PATH
from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.tracing.shared_metrics import join_models
from transport import Handler, HTTPError, JSONResponse, Request, Response

__all__ = ["BODY_MODEL_ROUTES", "ModelRouter", "Slot", "not_found"]

# The routes whose body names the model: those that generate, and those that read the
# model's tokenizer (each model may have its own).
BODY_MODEL_ROUTES = GENERATION_ROUTES | {
    "/v1/messages/count_tokens",
    *(prefix + route for prefix in ("", "/v1") for route in ("/tokenize", "/detokenize")),
}


@dataclass(frozen=True, slots=True)
class Slot:
    """One model's routes, and the names its requests may give (``OpenAIAPI.model_names``)."""

    model_id: str
    names: frozenset[str]
    handler: Handler


def not_found(name: str) -> Response:
    """OpenAI's 404 for a model the server does not have (as ``--strict-model-name``
    words it)."""
    return openai_error(
        OpenAIError(
            f"The model `{name}` does not exist.", 404, param="model", code="model_not_found"
        )
    )


class ModelRouter:
    """The slots' routers behind one handler, chosen by the request's model."""

    def __init__(self, slots: Sequence[Slot], auth: Auth) -> None:
        assert len(slots) > 1, "one model needs no ModelRouter"
        self.slots = tuple(slots)
        self.auth = auth  # the API keys every slot's router checks alike
        self._by_name: dict[str, Slot] = {}
        for slot in reversed(self.slots):  # a shared alias ("default") is the first's
            self._by_name.update(dict.fromkeys(slot.names, slot))
        for slot in self.slots:  # each id is its own model's, whatever aliases say
            self._by_name[slot.model_id] = slot

    async def __call__(self, request: Request) -> Response:
        path, first = request.path, self.slots[0]
        if path == "/v1/models" and request.method == "GET":
            return await self._models(request)
        if path.startswith("/v1/models/") and request.method == "GET":
            name = unquote(path.removeprefix("/v1/models/"))
            return await self._to(name, request, "/v1/models/{model:path}")
        if request.method == "GET":
            if path == "/health":
                return await self._health(request)
            join = _JOINED.get(path)
            if join is not None:
                return await self._joined(request, join)
        if request.method in ("POST", "PUT") and path in BODY_MODEL_ROUTES:
            model = await _model_of(request)
            if model is not None:
                return await self._to(model, request, path)
        if path == WS_PATH and request.method == "GET":  # a socket serves one model
            named = request.query().get("model")
            if named:
                return await self._to(named[-1], request, path)
        return await first.handler(request)

    async def _to(self, name: str, request: Request, route: str) -> Response:
        """The request answered by the model named ``name``. A name no model has is a
        404 in the route's API's shape, once the request passed the API-key check (a
        client without a key learns nothing of the models)."""
        slot = self._by_name.get(name)
        if slot is not None:
            return await slot.handler(request)
        answer = self.auth.check_route(request, route) or not_found(name)
        return anthropic_reply(answer) if route in ANTHROPIC_ROUTES else answer

    async def _models(self, request: Request) -> Response:
        """Every model's card, in the order they were given."""
        data: list[Any] = []
        for slot in self.slots:
            answer = await slot.handler(request)
            if answer.status != 200:
                return answer  # a 401 is the same for all
            data += orjson.loads(answer.body).get("data", [])
        return JSONResponse({"object": "list", "data": data})

    async def _joined(self, request: Request, join: Join) -> Response:
        """Every model's answer to ``request``, joined: the first that is not a 200 (a
        401 is the same for all) as it is; else the first's, with the joined body."""
        answers = [await slot.handler(request) for slot in self.slots]
        refused = next((a for a in answers if a.status != 200), None)
        if refused is not None:
            return refused
        ids = [slot.model_id for slot in self.slots]
        answers[0].body = join(ids, [a.body for a in answers])
        return answers[0]

    async def _health(self, request: Request) -> Response:
        """Healthy once every model is: the first answer that is not a 200, else the
        first model's."""
        answers = [await slot.handler(request) for slot in self.slots]
        return next((a for a in answers if a.status != 200), answers[0])


# Several models' answers (their ids, their bodies, in model order) as one body.
Join = Callable[[list[str], list[bytes]], bytes]


def _metrics(ids: list[str], bodies: list[bytes]) -> bytes:
    """One exposition: each model's series carry their ``model_name`` already."""
    return join_models(bodies)


def _server_info(ids: list[str], bodies: list[bytes]) -> bytes:
    """The first model's ``/server_info`` with every model's ``models`` entries."""
    first, *others = (orjson.loads(b) for b in bodies)
    for other in others:
        first["models"] += other["models"]
    return orjson.dumps(first)


def _load(ids: list[str], bodies: list[bytes]) -> bytes:
    """Every model's ``/get_load`` entries, each naming its ``model``, in model order."""
    return orjson.dumps(
        [
            {**entry, "model": m}
            for m, b in zip(ids, bodies, strict=True)
            for entry in orjson.loads(b)
        ]
    )


_JOINED: dict[str, Join] = {
    "/metrics": _metrics,
    "/server_info": _server_info,
    "/get_server_info": _server_info,
    "/get_load": _load,
}


async def _model_of(request: Request) -> str | None:
    """The body's ``model``; None when there is none (or no JSON object: the first
    model's route answers that error as it always does)."""
    try:
        body = await request.json()
    except HTTPError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
