"""Embeddings over HTTP: OpenAI's ``POST /v1/embeddings`` and SGLang's ``POST /encode``.

The bodies and OpenAI's reply are the face's without HTTP
(``lifecycle/faces/embeddings.py``, which the Engine's batch lines use too). Both run
``lifecycle.core.embed.embed``: the same call, state machine, admission and worker
batches as ``/generate``; a client that disconnects aborts its requests. The vector is
the model's final hidden state (after the final norm) pooled over the input, ``last``
position (default) or ``mean``, L2-normalised unless ``"normalize": false``:
``pooling`` and ``normalize`` are our extension fields on both routes. ``dimensions``
is refused unless it equals the model's hidden size (the model has no Matryoshka
truncation). Errors have each face's own shape: OpenAI's ``{"error": {message, type,
param, code}}`` on ``/v1/embeddings``, SGLang's ``{"error": {"message"}}`` on
``/encode``. An aborted request (``/abort_request``) has no vector: it answers 400
with code ``aborted``.
"""

from __future__ import annotations

from typing import Any

import anyio

from lifecycle.api.auth import owner
from lifecycle.api.calls import error_response, gone_cause
from lifecycle.api.openai import openai_error
from lifecycle.core.embed import Embeddings, EmbedInputs, embed
from lifecycle.core.errors import RequestError, ServeError
from lifecycle.core.states import Cause
from lifecycle.faces.embeddings import EmbeddingsFace, embed_options, with_openai_errors
from lifecycle.faces.openai_errors import OpenAIError
from transport import HTTPError, JSONResponse, Request, Response, Router

__all__ = ["EmbeddingsAPI"]


class EmbeddingsAPI(EmbeddingsFace):
    """The face on HTTP: its two routes, each call owned by its request."""

    def install(self, router: Router) -> None:
        router.add("POST", "/v1/embeddings", self.embeddings)
        router.add(["POST", "PUT"], "/encode", self.encode)

    async def _run(
        self, request: Request, inputs: EmbedInputs, body: dict[str, Any], rids: Any
    ) -> Embeddings | None:
        """``embed`` owned by this handler: None when the client left (the call was then
        closed client_gone, what the worker held aborted)."""
        pooling, normalize = embed_options(body)
        with anyio.CancelScope() as scope:
            forget = request.on_disconnect(scope.cancel)
            try:
                return await embed(
                    self.fe,
                    inputs,
                    pooling=pooling,
                    normalize=normalize,
                    rids=rids,
                    exit_cause=gone_cause(request),
                    owner=owner(request),
                )
            finally:
                forget()
        return None

    # -- OpenAI ------------------------------------------------------------------------------
    async def embeddings(self, request: Request) -> Response:
        try:
            body = await request.json()
        except HTTPError as exc:
            return openai_error(OpenAIError(exc.message, exc.status))
        try:
            inputs, fmt = self.openai_body(body)
            result = await with_openai_errors(self._run(request, inputs, body, None))
        except OpenAIError as exc:
            return openai_error(exc, exc.retry_after)
        if result is None:
            return Response(b"", 499)  # nobody reads it
        return JSONResponse(self.openai_reply(result, fmt))

    # -- SGLang /encode ----------------------------------------------------------------------
    async def encode(self, request: Request) -> Response:
        body = await request.json()
        try:
            inputs, is_batch, rids = self.encode_body(body)
            result = await self._run(request, inputs, body, rids)
        except RequestError as exc:
            return error_response(exc.status, exc.message)
        except ServeError as exc:
            status = 400 if exc.cause is Cause.ABORTED else exc.cause.status
            return error_response(status, exc.message, exc.cause.retry_after)
        if result is None:
            return Response(b"", 499)
        items = result.encode_results()
        return JSONResponse(items if is_batch else items[0])
