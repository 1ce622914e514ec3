"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

Bodies are checked and replies shaped by the face without HTTP
(``lifecycle/faces/openai.py``, which the Engine's batch lines use too); here they are
read from the request and run through the same ``Frontend`` as ``/generate``: one state
machine, one admission queue, one disconnect and error path. Everything refused before
the stream starts is an OpenAI error body with its status (400 bad input, 404
``model_not_found``, 503 not ready or overloaded); once SSE headers are out, an error is
a ``data: {"error": {...}}`` chunk followed by ``data: [DONE]``, so a truncated stream
never looks like success.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import unquote

import orjson

from lifecycle.api.calls import http_call, run_unary
from lifecycle.core.call import GenerateCall
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.faces.openai import OpenAIFace
from lifecycle.faces.openai_errors import OpenAIError
from lifecycle.faces.openai_outputs import ChoiceState, ReplyIds
from lifecycle.faces.openai_params import OpenAIRequest
from transport import HTTPError, JSONResponse, Request, Response, Router, SSEResponse

__all__ = ["OpenAIAPI", "openai_error", "run_call", "start_call"]

log = logging.getLogger("lifecycle.api.openai")


def openai_error(exc: OpenAIError, retry_after: int | None = None) -> Response:
    headers = [("retry-after", str(retry_after))] if retry_after else None
    return JSONResponse(exc.body(), exc.status, headers)


class OpenAIAPI(OpenAIFace):
    """The face on HTTP: its routes, the body read from the request, the SSE stream."""

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/completions", self.completions)
        router.add("POST", "/v1/chat/completions", self.chat_completions)
        router.add("GET", "/v1/models", self.models)
        router.add("GET", "/v1/models/{model:path}", self.model)

    # -- models ------------------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.card()]})

    async def model(self, request: Request) -> Response:
        name = unquote(request.path_params.get("model", ""))
        if name not in self.model_names:
            return openai_error(
                OpenAIError(
                    f"The model `{name}` does not exist.",
                    404,
                    param="model",
                    code="model_not_found",
                )
            )
        return JSONResponse(self.card())

    # -- generation --------------------------------------------------------------------------
    async def json_body(self, request: Request) -> Any:
        """The body as JSON; its refusal as an ``OpenAIError``."""
        try:
            return await request.json()
        except HTTPError as exc:  # invalid JSON (400), a body over the limit (413)
            raise OpenAIError(exc.message, exc.status) from None

    async def completions(self, request: Request) -> Response:
        return await self._create(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._create(request, chat=True)

    async def _create(self, request: Request, chat: bool) -> Response:
        try:
            oreq, prompts, echo, param = await self.prompt(chat, await self.json_body(request))
        except OpenAIError as exc:
            return openai_error(exc)
        return await self._generate(request, oreq, prompts, echo, param)

    async def _generate(
        self,
        request: Request,
        oreq: OpenAIRequest,
        prompts: list[str | list[int]],
        echo: list[str],
        prompt_param: str,
    ) -> Response:
        async with http_call(self.fe, oreq.generate_request(prompts), request) as call:
            refused = await start_call(call, prompt_param)
            if refused is not None:
                return refused
            choices = self.choices(call, oreq, echo)
            ids = self.ids(oreq)
            if oreq.stream:
                events = self._events(call, oreq, choices, ids)
                return await request.respond(SSEResponse(events))
            return await self._unary(call, request, oreq, choices, ids)

    async def _unary(
        self,
        call: GenerateCall,
        request: Request,
        oreq: OpenAIRequest,
        choices: list[ChoiceState],
        ids: ReplyIds,
    ) -> Response:
        refused = await run_call(call, request)
        if refused is not None:
            return refused
        body = self.reply_body(call, oreq, choices, ids)
        return JSONResponse(body)

    async def _events(
        self,
        call: GenerateCall,
        oreq: OpenAIRequest,
        choices: list[ChoiceState],
        ids: ReplyIds,
    ) -> AsyncIterator[bytes]:
        """The stream's chunks; owns nothing (the handler's call scope does)."""
        obj = "chat.completion.chunk" if oreq.chat else "text_completion"

        def chunk(choice: dict[str, Any]) -> bytes:
            out = {**ids.envelope(obj), "choices": [choice]}
            if oreq.continuous_usage:
                out["usage"] = self.usage(call)  # so far
            elif oreq.include_usage:
                out["usage"] = None
            return orjson.dumps(out)

        if oreq.chat:
            for state in sorted(choices, key=lambda c: c.index):
                yield chunk(state.role_choice())
        async for index, _sample, frame in call.frames(True):
            for choice in choices[index].chunk_choices(frame):
                yield chunk(choice)
        err = call.error()
        if err is not None:
            cause, message = err
            yield orjson.dumps(OpenAIError.from_cause(cause, message).body())
        elif oreq.include_usage:
            final = self.usage(call, choices)
            yield orjson.dumps({**ids.envelope(obj), "choices": [], "usage": final})
        yield b"[DONE]"


async def start_call(call: GenerateCall, param: str | None) -> Response | None:
    """``call.start()``; the OpenAI error reply when it was refused (``param``: the field
    a 4xx names), else None."""
    try:
        await call.start()
    except RequestError as exc:
        return openai_error(OpenAIError.from_cause(exc.cause, exc.message, param))
    except ServeError as exc:
        err = OpenAIError.from_cause(exc.cause, exc.message)
        return openai_error(err, exc.cause.retry_after)
    return None


async def run_call(call: GenerateCall, request: Request) -> Response | None:
    """Run a unary call to its end; the reply when it did not end well (499 when the
    client left, the OpenAI error when it failed), else None."""
    if not await run_unary(call, request):
        return Response(b"", 499)  # nobody reads it; the scope closes the call
    failed = call.error()
    if failed is not None:
        cause, message = failed
        return openai_error(OpenAIError.from_cause(cause, message), cause.retry_after)
    return None
