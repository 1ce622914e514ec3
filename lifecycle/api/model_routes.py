"""The routes of several models behind one handler (``--model`` repeated; the slots are
``lifecycle.app.slot_configs``): each request goes to the model its ``model``
names: the body's ``model`` on every route that generates (the native ``/generate``
too), the path's on ``/v1/models/{model}``; a request that names none goes to the first
model; a name no model has is OpenAI's 404 ``model_not_found``. ``/v1/models`` lists
every model; ``/health`` is 200 once every model is ready. Every other route (metrics,
debug, admin) is the first model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import orjson

from lifecycle.api.anthropic_params import ANTHROPIC_ROUTES, anthropic_reply
from lifecycle.api.auth import Auth
from lifecycle.api.openai import openai_error
from lifecycle.api.openai_errors import OpenAIError
from lifecycle.api.routes import GENERATION_ROUTES
from transport import Handler, HTTPError, JSONResponse, Request, Response

__all__ = ["ModelRouter", "Slot", "not_found"]


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
        if path == "/health" and request.method == "GET":
            return await self._health(request)
        if request.method == "POST" and path in GENERATION_ROUTES:
            model = await _model_of(request)
            if model is not None:
                return await self._to(model, request, path)
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

    async def _health(self, request: Request) -> Response:
        """Healthy once every model is: the first answer that is not a 200, else the
        first model's."""
        answers = [await slot.handler(request) for slot in self.slots]
        return next((a for a in answers if a.status != 200), answers[0])


async def _model_of(request: Request) -> str | None:
    """The body's ``model``; None when there is none (or no JSON object: the first
    model's route answers that error as it always does)."""
    try:
        body = await request.json()
    except HTTPError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
